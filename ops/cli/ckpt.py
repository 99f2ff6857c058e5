"""`ptops ckpt ...`: list, verify and digest checkpoints (typer sub-app).

Exit codes: 0 ok; 1 a checkpoint is invalid (verify) or none is good (digest of a
run); 2 bad input (missing path, not a checkpoint). Heavy imports stay inside the
commands.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ptops.ops.cli.errors import fail

app = typer.Typer(
    help="List, verify and digest TorchTitan (DCP) and TRL/HF checkpoints.", no_args_is_help=True
)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command("list")
def list_cmd(
    run_dir: Path = typer.Argument(
        ..., help="Run directory (uses RUN_DIR/checkpoints) or a checkpoints folder."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    deep: bool = typer.Option(
        False, "--deep", help="Also hash files against their manifests (slower)."
    ),
) -> None:
    """List checkpoints newest first: step, kind, ok, reason, size."""
    from ptops.ckpt import checkpoints_dir, list_checkpoints, read_latest

    if not run_dir.exists():
        fail(f"run directory not found: {run_dir}", 2)
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        fail(f"no checkpoints folder: {root}", 2)
    entries = list_checkpoints(root, deep=deep)
    latest = read_latest(root)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "checkpoints_dir": str(root),
                    "latest": latest.name if latest else None,
                    "checkpoints": [e.to_dict() for e in entries],
                },
                indent=1,
            )
        )
        return
    if not entries:
        typer.echo(f"no checkpoints in {root}")
        return
    rows = [("STEP", "KIND", "OK", "SIZE", "NAME", "REASON")]
    for e in entries:
        name = Path(e.path).name + (
            " (LATEST)" if latest and latest.name == Path(e.path).name else ""
        )
        rows.append(
            (
                str(e.step),
                e.kind,
                "yes" if e.ok else "NO",
                _human(e.size_bytes),
                name,
                e.reason or ("" if e.has_manifest else "(no manifest: structure only)"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


@app.command("verify")
def verify_cmd(
    path: Path = typer.Argument(..., help="A checkpoint folder (step-N/ or checkpoint-N/)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full result as JSON."),
    quick: bool = typer.Option(
        False, "--quick", help="Sizes and structure only; skip hashing/CRC reads."
    ),
) -> None:
    """Verify a checkpoint; exit 1 naming the bad file when invalid."""
    from ptops.ckpt import verify

    if not path.exists():
        fail(f"checkpoint not found: {path}", 2)
    if not path.is_dir():
        fail(f"not a checkpoint folder: {path}", 2)
    from ptops.ckpt import MANIFEST_NAME, detect_kind

    if detect_kind(path) == "unknown" and not (path / MANIFEST_NAME).exists():
        fail(
            f"not a checkpoint folder (expected step-N/ or checkpoint-N/): {path}; "
            f"to see a run's checkpoints use `ptops ckpt list`",
            2,
        )
    res = verify(path, deep=not quick)
    if as_json:
        typer.echo(json.dumps(res.to_dict(), indent=1))
    elif res.ok:
        how = (
            "manifest hashes"
            if res.has_manifest and not quick
            else ("manifest sizes" if res.has_manifest else "structure only, no manifest")
        )
        typer.echo(f"ok: {path} ({res.kind}, step {res.step}, {how})")
    else:
        typer.echo(
            f"invalid: {path}/{res.problems[0]['file']}: {res.problems[0]['reason']}"
            + (f" (+{len(res.problems) - 1} more)" if len(res.problems) > 1 else ""),
            err=True,
        )
    if not res.ok:
        raise typer.Exit(1)


@app.command("digest")
def digest_cmd(
    path: Path = typer.Argument(
        ..., help="A checkpoint folder, or a run directory (its latest good checkpoint)."
    ),
) -> None:
    """Print one hex digest of the model and optimizer tensor contents."""
    from ptops.ckpt import DigestError, digest

    if not path.exists():
        fail(f"path not found: {path}", 2)
    try:
        typer.echo(digest(path))
    except DigestError as e:
        fail(str(e), 1)
    except (OSError, ValueError, KeyError) as e:
        fail(f"cannot digest {path}: {type(e).__name__}: {e}", 1)
