"""`gpuhook doctor`: thin click wrapper; checks run in host, runtimes, specs and container, rendering here."""

from __future__ import annotations

import json

import click

from gpuhook.cdi.registry import DEFAULT_SPEC_DIRS
from gpuhook.doctor.model import INFO, OK, PROBLEM, SECTIONS, WARN, Finding, Report

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.discover.roots import Roots

TITLES = {"host": "host", "service": "service", "runtimes": "runtimes", "cdi": "CDI specs", "container": "container"}
LABELS = {OK: "ok", INFO: "info", WARN: "WARN", PROBLEM: "PROBLEM"}


def _pairs(values: tuple[str, ...], what: str) -> list[str]:
    for value in values:
        if "=" not in value or value.startswith("="):
            raise click.BadParameter(f"{value!r}: expected KEY=VALUE", param_hint=what)
    return list(values)


def generate_flags(roots: Roots, discovery: str) -> str:
    """The root options a suggested `gpuhook generate-cdi` needs to see the same driver as this check."""
    flags = ""
    if roots.driver_root != "/":
        flags += f" --driver-root {roots.driver_root}"
    if roots.dev_root != roots.driver_root:
        flags += f" --dev-root {roots.dev_root}"
    if roots.proc_root != "/proc":
        flags += f" --proc-root {roots.proc_root}"
    if discovery != "auto":
        flags += f" --discovery {discovery}"
    return flags


def render(report: Report) -> str:
    """Every finding, by section (SECTIONS' order, then any other: the count at the end is of what is printed)."""
    lines: list[str] = []
    others = [s for s in dict.fromkeys(f.section for f in report.findings) if s not in SECTIONS]
    for section in (*SECTIONS, *others):
        found = [f for f in report.findings if f.section == section]
        if not found:
            continue
        lines.append(TITLES.get(section, section))
        for f in found:
            lines += _render_one(f)
    problems, warnings = report.count(PROBLEM), report.count(WARN)
    lines.append("no problems found" if not problems and not warnings else
                 f"{problems} problem(s), {warnings} warning(s)")
    return "\n".join(lines)


def _render_one(f: Finding) -> list[str]:
    out = [f"  {LABELS[f.status]:<8} {f.message}"]
    out += [f"           {line}" for line in f.detail]
    if f.fix:
        out.append(f"           fix: {f.fix}")
    return out


@click.command("doctor")
@click.option("--driver-root", default=None, help="Root of the driver install [default: the hook config's, else /].")
@click.option("--dev-root", default=None, help="Root holding /dev [default: the hook config's, else driver root].")
@click.option("--proc-root", default=None, help="procfs with /driver/nvidia [default: the hook config's, else /proc].")
@click.option("--discovery", type=click.Choice(["auto", "nvml", "procfs"]), default="auto", show_default=True)
@click.option("--config", "config_path", default=None, metavar="FILE",
              help="The hook's config (policy, roots) [default: /etc/gpuhook/config.toml if present].")
@click.option("--bundle", default=None, metavar="DIR", help="Explain this OCI bundle's container (its config.json).")
@click.option("--env", "env", multiple=True, metavar="KEY=VAL", help="Explain a container with this env; repeatable.")
@click.option("--annotation", "annotations", multiple=True, metavar="KEY=VAL",
              help="With --env: an OCI annotation (e.g. cdi.k8s.io/…); repeatable.")
@click.option("--device-mount", "device_mounts", multiple=True, metavar="ID",
              help="With --env: a /dev/null mount at /var/run/nvidia-container-devices/ID; repeatable.")
@click.option("--privileged", is_flag=True, help="With --env: the container has CAP_SYS_ADMIN.")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR",
              help="CDI spec directory, lowest priority first; repeatable [default: /etc/cdi /var/run/cdi]. "
                   "Runtimes left at their default CDI directories are checked against these.")
@click.option("--runtime", "runtimes", multiple=True,
              type=click.Choice(["runc", "podman", "containerd", "crio", "docker", "none"]),
              help="Check these runtimes' configuration; repeatable [default: every one installed].")
@click.option("--kubernetes-node", is_flag=True,
              help="A Kubernetes node: CDI on in the runtime is enough (the device plugin or the DRA driver writes "
                   "the specs of the GPUs it allocates); node-setup's readiness probe passes it.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report (see docs/doctor.md).")
def doctor(driver_root: str | None, dev_root: str | None, proc_root: str | None, discovery: str,
           config_path: str | None, bundle: str | None, env: tuple[str, ...], annotations: tuple[str, ...],
           device_mounts: tuple[str, ...], privileged: bool, spec_dirs: tuple[str, ...], runtimes: tuple[str, ...],
           kubernetes_node: bool, as_json: bool) -> None:
    """Check the host, the runtimes and the CDI specs; explain what a container gets and why. Exit 1 on problems."""
    from gpuhook.cli.inventory import resolve_roots
    from gpuhook.doctor import container, host, specs
    from gpuhook.doctor import runtimes as rt
    from gpuhook.errors import GpuhookError
    from gpuhook.hook.config import Config, load_config

    if bundle and (env or annotations or device_mounts or privileged):
        raise click.UsageError("--bundle and --env/--annotation/--device-mount/--privileged are exclusive")
    report = Report()
    try:
        config = load_config(config_path, warn=False)  # what it ignores is a finding here, not a stderr line
        if config_path or config.source != "(defaults)":
            report.add([Finding("host", OK, f"hook config {config.source} reads")])
        if config.ignored:
            report.add([Finding("host", INFO, f"hook config {config.source}: NVIDIA settings gpuhook ignores: "
                                              + "; ".join(config.ignored))])
    except GpuhookError as exc:
        config = Config()
        report.add([Finding("host", PROBLEM, f"hook config: {exc} (checking with defaults)",
                            f"fix {config_path or '/etc/gpuhook/config.toml'}")])
    roots = resolve_roots(driver_root, dev_root, proc_root, config)
    inv, found = host.check_host(roots, discovery)
    report.add(found)
    report.add(host.check_ldconfig(config.ldconfig))
    from gpuhook.doctor.entries import check_entries

    report.add(check_entries())
    flags = generate_flags(roots, discovery)
    dirs = tuple(spec_dirs or DEFAULT_SPEC_DIRS)
    found, status = specs.check_specs(dirs, inv, flags)
    chosen = [r for r in runtimes if r != "none"] if runtimes else rt.installed()
    paths = rt.Paths(generate_flags=flags, spec_dirs=dirs, kubernetes_node=kubernetes_node)
    report.add(rt.check_runtimes(chosen, status, paths))
    report.add(rt.check_cdi_ignored(config.state_dir))
    from gpuhook.doctor.service import check_service

    report.add(check_service())
    if inv is not None:
        from gpuhook.doctor.systemd import check_dev_char

        report.add(check_dev_char(inv, paths))
    report.add(found)
    if bundle or env or annotations or device_mounts:
        try:
            inp = (container.from_bundle(bundle) if bundle else
                   container.from_env(_pairs(env, "--env"), dict(a.split("=", 1) for a in _pairs(annotations,
                                      "--annotation")), privileged, device_mounts))
        except GpuhookError as exc:
            report.add([Finding("container", PROBLEM, str(exc), "give the bundle directory holding config.json")])
        else:
            steps, report.container = container.explain(inp, inv, config)
            report.add(steps)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else render(report))
    if not report.ok:
        raise SystemExit(1)
