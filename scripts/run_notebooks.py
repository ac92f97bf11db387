"""Execute every notebook in notebooks/ top to bottom, as a reader would; fail on the first error.

    python scripts/run_notebooks.py [notebooks/00-setup.ipynb ...]
    python scripts/run_notebooks.py --write notebooks/12-engine.ipynb   # save the new outputs too

Each notebook runs in a fresh kernel with notebooks/ as its working directory (so it can
import its helper modules and spawn ranks that import them). Outputs are not written back
unless --write is given: CI checks that the notebooks work, it does not change them; --write
refreshes a notebook's stored outputs after the code it shows has changed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT_S = 600  # a cell that trains on ranks may take minutes on 2 cores


def main(paths: list[str]) -> int:
    console, write = Console(), "--write" in paths
    if {"-h", "--help"} & set(paths):
        print(__doc__)
        return 0
    unknown = [p for p in paths if p.startswith("-") and p != "--write"]
    if unknown:
        console.print(f"[red]unknown option {unknown[0]!r}[/red]: the options are --write and --help")
        return 2
    paths = [p for p in paths if p != "--write"]
    notebooks = [Path(p).resolve() for p in paths] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    if not notebooks:
        console.print("[red]no notebooks found[/red]")
        return 1
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        start = time.perf_counter()
        with console.status(f"executing {path.relative_to(ROOT)} ({len(nb.cells)} cells)"):
            try:
                client.execute()
            except Exception as err:  # noqa: BLE001 - report which notebook, then fail
                console.print(f"[red]FAILED[/red] {path.relative_to(ROOT)}:\n{err}")
                return 1
        console.print(f"[green]ok[/green] {path.relative_to(ROOT)} in {time.perf_counter() - start:.0f} s")
        if write:
            nbformat.write(nb, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
