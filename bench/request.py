"""Request parsing of hostile sizes: NVIDIA_VISIBLE_DEVICES and cdi.k8s.io annotations, in process.

Cases: 4,096 ids (the bound, accepted), 150,000 ids (refused by the size bound before any per-item work), a
200,000-name annotation (refused), 4,096 one-name annotations (accepted). The parse used to test membership in a
list per id: 10,000 ids took 0.5 s, 150,000 took 99 s. Reported, not asserted (the tests never time anything).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable

from _common import interleaved, main_guard, parse_args, print_table, row, write_json

from gpuhook.errors import RequestError
from gpuhook.model.request import parse_request

TARGET_MS = 50.0  # any one request, accepted or refused


def _ids(n: int) -> str:
    return ",".join(f"GPU-{i:08d}" for i in range(n))


CASES: dict[str, tuple[list[str], dict[str, object]]] = {
    "env 4,096 ids (accepted)": ([f"NVIDIA_VISIBLE_DEVICES={_ids(4096)}"], {}),
    "env 150,000 ids (refused)": ([f"NVIDIA_VISIBLE_DEVICES={','.join(str(i) for i in range(150_000))}"], {}),
    "annotation 200,000 names (refused)": ([], {"cdi.k8s.io/x": ",".join(f"nvidia.com/gpu={i}"
                                                                          for i in range(200_000))}),
    "4,096 annotations of one name (accepted)": ([], {f"cdi.k8s.io/a{i}": f"nvidia.com/gpu={i}"
                                                      for i in range(4096)}),
}


def _timer(env: list[str], annotations: dict[str, object]) -> Callable[[int], float]:
    def once(_round: int) -> float:
        start = time.perf_counter()
        with contextlib.suppress(RequestError):
            parse_request(env, (), annotations)
        return (time.perf_counter() - start) * 1000

    return once


def bench(args: argparse.Namespace) -> None:
    load_before = list(os.getloadavg())
    samples = interleaved({name: _timer(*case) for name, case in CASES.items()}, args.runs, seed=args.seed)
    rows = [row(name, samples[name], TARGET_MS) for name in CASES]
    print_table("parse_request of hostile sizes", rows)
    write_json(args, {"rows": rows}, load_before)


if __name__ == "__main__":
    main_guard(bench, parse_args("request", __doc__))
