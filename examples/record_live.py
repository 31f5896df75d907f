"""Record `deepr run` and `deepr build-trees` as a terminal shows them, live view included, into
SVGs for the docs (rich's recording console; the model is the loopback competent fake of the
tests, tests/fake_model.py, the corpus the tests' volcano documents).

    python examples/record_live.py docs/img      # writes live_run.svg and live_build_trees.svg
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def record(args: list[str], svg: Path, title: str) -> int:
    """Run ``deepr <args>`` with every CLI module printing to one recording terminal console."""
    import typer
    from rich.console import Console

    import deepr.cli  # noqa: F401  (registers the commands)
    from deepr.cli.app import app

    screen = Console(record=True, force_terminal=True, width=110, file=io.StringIO(), color_system="truecolor")
    for name, mod in list(sys.modules.items()):
        if name.startswith("deepr.cli") and isinstance(getattr(mod, "console", None), Console):
            mod.console = screen
    screen.print(f"[bold green]$[/] deepr {' '.join(a if ' ' not in a else repr(a) for a in args)}", highlight=False)
    try:
        code = app(args, standalone_mode=False)
    except (SystemExit, typer.Exit) as e:
        code = getattr(e, "exit_code", getattr(e, "code", 1))
    screen.save_svg(str(svg), title=title)
    return int(code or 0)


def main(folder: Path) -> None:
    from fake_model import CompetentModel
    from tree_helpers import volcano_docs

    from deepr.llm.stub_server import StubServer

    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    home = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp, StubServer(CompetentModel()) as srv:
        os.chdir(tmp)  # short relative paths on the recorded screen
        try:
            Path("volcano.jsonl").write_text("".join(d.model_dump_json() + "\n" for d in volcano_docs()),
                                             encoding="utf-8")
            Path("topics.txt").write_text("Volcano\nPlate tectonics\n", encoding="utf-8")
            model = ["--llm", "openai:fake", "--base-url", srv.base_url, "--no-cache", "--deadline", "300"]
            common = ["--corpus", "volcano.jsonl", "--cache-dir", "cache"]
            codes = [record(["run", "How do volcanic eruptions affect the climate?", "--out", "report.md",
                             *common, *model], folder / "live_run.svg", "deepr run"),
                     record(["build-trees", "--topics", "topics.txt", "--out", "trees.jsonl", *common, *model],
                            folder / "live_build_trees.svg", "deepr build-trees")]
        finally:
            os.chdir(home)
    if any(codes):
        raise SystemExit(f"a recorded command failed: exit statuses {codes}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img"))
