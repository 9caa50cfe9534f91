"""Man pages made from the commands' own help, at package build time (packaging/build.py puts them in the .deb).

- gpuhook.1: `gpuhook --help`, then every command and subcommand's `--help` as click prints it (usage, text,
  options), so the page can never say anything the command does not;
- gpuhook-hook.1: the hook entry's `--help` (hook/prestart.HELP);
- gpuhook-runtime.1: the shim's own description (its `--help` is the real runtime's, as runc's would be).

Each help text goes in verbatim (`.nf`), escaped for roff, at 78 columns. `python packaging/manpages.py DIR` writes
them into DIR (uncompressed).
"""

from __future__ import annotations

import sys
from pathlib import Path

WIDTH = 78


def _roff(text: str) -> str:
    """`text` safe inside a .nf block: backslashes escaped, a line starting with '.' or "'" kept as text, and
    every character beyond ASCII written as roff's \\[uXXXX] (so no preprocessor is needed)."""
    out = []
    text = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text.replace("\\", "\\e"))
    for line in text.splitlines():
        out.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(out)


def _filled(text: str) -> str:
    """Paragraphs (blank-line separated) rewrapped to WIDTH."""
    import textwrap

    return "\n\n".join(textwrap.fill(" ".join(p.split()), WIDTH - 8) for p in text.split("\n\n") if p.strip())


def _page(name: str, summary: str, version: str, sections: list[tuple[str, str]]) -> str:
    head = (f'.TH {name.upper()} 1 "" "gpuhook {version}" "gpuhook manual"\n'
            f".SH NAME\n{name} \\- {_roff(summary)}\n")
    # a title "gpuhook list" (a command's path) is a subsection of COMMANDS
    body = ""
    for title, text in sections:
        command = title.startswith("gpuhook ")
        if command and ".SH COMMANDS" not in body:
            body += ".SH COMMANDS\n"
        body += (f'.SS "{title}"' if command else f".SH {title}") + f"\n.nf\n{_roff(text.rstrip())}\n.fi\n"
    see = ".SH SEE ALSO\n" + ", ".join(f"\\fB{n}\\fR(1)" for n in ("gpuhook", "gpuhook-hook", "gpuhook-runtime")
                                       if n != name) + "\n"
    return head + body + see


def _click_helps() -> list[tuple[str, str]]:
    """(command path, its --help text) for gpuhook and every command under it, depth first, in help order."""
    import click

    from gpuhook.cli.app import cli

    out: list[tuple[str, str]] = []

    def walk(command: click.Command, name: str, parent: click.Context | None) -> None:
        ctx = click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
        out.append((ctx.command_path, command.get_help(ctx)))
        if isinstance(command, click.Group):
            for sub in command.list_commands(ctx):
                child = command.get_command(ctx, sub)
                if child is not None and not child.hidden:
                    walk(child, sub, ctx)

    walk(cli, "gpuhook", None)
    return out


def pages() -> dict[str, str]:
    """File name -> the page's roff text."""
    from gpuhook import __version__ as version
    from gpuhook.hook.prestart import HELP
    from gpuhook.shim import runtime

    helps = _click_helps()
    (_, top), commands = helps[0], helps[1:]
    gpuhook = _page("gpuhook", "NVIDIA GPUs in containers: CDI specs, an OCI prestart hook, a runtime shim, "
                               "kubelet plugins", version,
                    [("SYNOPSIS AND DESCRIPTION", top), *commands])
    usage, _, text = HELP.partition("\n\n")
    hook = _page("gpuhook-hook", "the OCI prestart hook entry", version,
                 [("SYNOPSIS", usage), ("DESCRIPTION", _filled(text))])
    shim_doc = _filled((runtime.__doc__ or "").strip())
    shim = _page("gpuhook-runtime", "an OCI runtime shim that gives GPU containers their devices", version,
                 [("SYNOPSIS", "gpuhook-runtime [RUNC OPTIONS] COMMAND [ARGS]..."), ("DESCRIPTION", shim_doc)])
    return {"gpuhook.1": gpuhook, "gpuhook-hook.1": hook, "gpuhook-runtime.1": shim}


def write(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in pages().items():
        path = dest / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    for page in write(Path(sys.argv[1] if len(sys.argv) > 1 else ".")):
        print(page)
