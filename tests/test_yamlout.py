"""The spec writer (cdi/yamlout.py) against PyYAML's reader: whatever it writes reads back as the same data, and
strings that YAML 1.1 readers (Go's included) would take for something else are quoted."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.cdi_inventory import synthetic_inventory

from gpuhook.cdi import codec
from gpuhook.cdi.spec import build_spec
from gpuhook.cdi.yamlout import dump, scalar

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=12)
documents = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=25)


@settings(max_examples=1500, deadline=None)
@given(documents)
def test_everything_written_reads_back_the_same(document: Any) -> None:
    assert repr(yaml.safe_load(dump(document))) == repr(document)  # repr: nan == nan


@given(st.sampled_from(["on", "Off", "y", "N", "yes", "NO", "true", "False", "null", "~", "1", "0x1f", "1e3", "1.5",
                        "2001-12-14", "-", "- x", "a: b", "a #b", "*alias", "&anchor", "!tag", "%x", "@x", "`x",
                        "'x'", '"x"', "x ", " x", "", "{a}", "[a]", "?", ".inf", ".NaN", "0o17", "\u2028", "é"]))
def test_ambiguous_strings_are_quoted(text: str) -> None:
    written = scalar(text)
    assert written.startswith('"'), written
    assert yaml.safe_load(f"k: {written}") == {"k": text}


def test_paths_and_names_stay_plain() -> None:
    for text in ("/usr/lib/x86_64-linux-gnu/libcuda.so.535.309.01", "nvidia.com/gpu", "NVIDIA_VISIBLE_DEVICES=void",
                 "create-symlinks", "libcuda.so.1::/usr/lib/libcuda.so", "ro", "nosuid", "0.5.0", "535.309.01"):
        assert scalar(text) == text


def test_a_generated_spec_round_trips_through_both_readers() -> None:
    spec = build_spec(synthetic_inventory(3, mig_per_gpu=2), hook_path="/usr/local/bin/gpuhook-hook")
    text = codec.dumps(spec)
    assert yaml.safe_load(text) == spec
    assert codec.loads(text) == spec


def test_writing_a_spec_does_not_import_pyyaml() -> None:
    code = ("import sys; from gpuhook.cdi import codec; codec.dumps({'cdiVersion': '0.6.0', 'kind': 'a.b/c', "
            "'devices': [{'name': '0', 'containerEdits': {'env': ['A=1']}}]}); print('yaml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
