"""The `safepoint` command: output and exit status of `ls`, `info` and `verify`, human and
--json, on real checkpoints; and that it runs without importing torch."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import safepoint as sp
from safepoint._format import seal
from safepoint.cli import _human_bytes, main
from safepoint.testing import FaultyStorage


def _state() -> dict[str, Any]:
    return {
        "weights": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4)},
        "step": 7,
        "name": "x" * 100,
        "blob": b"abc",
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A committed checkpoint of numpy arrays and plain values, with metadata."""
    path = tmp_path / "ckpt"
    sp.save(str(path), _state(), metadata={"epoch": 3})
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root holding step_2 and step_10 (committed) and step_20 (data, no manifest)."""
    root = tmp_path / "run"
    sp.save(str(root / "step_2"), _state())
    sp.save(str(root / "step_10"), {"w": np.ones(1000)})
    sp.save(str(root / "step_20"), {"w": np.ones(10)})
    (root / "step_20" / "manifest.json").unlink()
    (root / "notes").mkdir()
    return root


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _flip_byte(ckpt: Path) -> None:
    (data,) = (ckpt / "data").glob("*.bin")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))



def test_ls_names_a_link_to_a_checkpoint_and_where_it_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning's last.ckpt with save_last="link" is listed, with the checkpoint it leads to
    (it was not listed at all)."""
    sp.save(str(tmp_path / "epoch=1.ckpt"), {"w": np.zeros(3)})
    (tmp_path / "last.ckpt").symlink_to("epoch=1.ckpt")
    code, out, _ = _run(capsys, "ls", str(tmp_path))
    assert code == 0
    assert [line.split()[:3] for line in out.splitlines()[1:]] == [
        ["epoch=1.ckpt", sp.info(str(tmp_path / "epoch=1.ckpt")).created, "1"],
        ["last.ckpt", "->", "epoch=1.ckpt"]]
    code, out, _ = _run(capsys, "ls", "--json", str(tmp_path))
    link = json.loads(out)["checkpoints"][1]
    assert (link["name"], link["link"]) == ("last.ckpt", "epoch=1.ckpt")

@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 << 20, "3.0 MiB"), (5 << 40, "5.0 TiB"),
     (2048 << 40, "2048.0 TiB")],
)
def test_human_bytes(nbytes: int, text: str) -> None:
    assert _human_bytes(nbytes) == text


def test_ls_lists_committed_checkpoints_in_natural_order(capsys, root):
    code, out, err = _run(capsys, "ls", str(root))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "CREATED", "ENTRIES", "SIZE"]
    assert [line.split()[0] for line in lines[1:3]] == ["step_2", "step_10"]
    assert lines[2].split()[2:] == ["1", "7.8", "KiB"]
    assert "step_20" not in "\n".join(lines[:3])
    assert "1 uncommitted leftover(s)" in lines[3] and "step_20" in lines[3]
    assert "a crashed save's, or a save still in progress" in lines[3]  # ls beside a job
    assert "notes" not in out
    assert err == ""


def test_ls_json(capsys, root):
    code, out, _ = _run(capsys, "ls", "--json", str(root))
    assert code == 0
    listing = json.loads(out)
    assert [c["name"] for c in listing["checkpoints"]] == ["step_2", "step_10"]
    assert listing["checkpoints"][1] == {
        "name": "step_10", "url": f"{root}/step_10",
        "created": sp.info(str(root / "step_10")).created, "entries": 1, "nbytes": 8000,
    }
    assert listing["uncommitted"] == [{"name": "step_20", "files": 1}]
    assert listing["unreadable"] == []


def test_ls_of_a_checkpoint_lists_just_it(capsys, ckpt):
    code, out, _ = _run(capsys, "ls", str(ckpt))
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == ["NAME", str(ckpt)]


def test_ls_finds_nothing(capsys, tmp_path):
    (tmp_path / "leftover" / "data").mkdir(parents=True)
    (tmp_path / "leftover" / "data" / f"{uuid.uuid4().hex}-r00000-0000.bin").write_bytes(b"123")
    code, out, err = _run(capsys, "ls", str(tmp_path))
    assert code == 1
    assert "no committed checkpoint" in err and str(tmp_path) in err
    assert "1 uncommitted leftover(s)" in out

    code, _, err = _run(capsys, "ls", str(tmp_path / "missing"))
    assert code == 1
    assert len(err.splitlines()) == 1


def test_ls_of_an_uncommitted_leftover_says_so(capsys, tmp_path):
    """DIR itself is where a save crashed (the directory `safepoint info` sends one here about)."""
    leftover = tmp_path / "ckpt"
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / f"{uuid.uuid4().hex}-r00000-0000.bin").write_bytes(b"x" * 10)
    code, out, err = _run(capsys, "ls", str(leftover))
    assert code == 1
    assert "1 uncommitted leftover(s)" in out and str(leftover) in out
    assert "only leftovers of saves that never committed" in err and "check the path" not in err
    code, out, _ = _run(capsys, "ls", "--json", str(leftover))
    assert code == 1
    assert json.loads(out)["uncommitted"] == [{"name": str(leftover), "files": 1}]


def test_ls_of_a_directory_with_step_named_checkpoints_lists_the_others_too(capsys, tmp_path):
    """Composer-style names, or a manager root beside which the user saved `final`."""
    for name in ("step-1000", "final", "best"):
        sp.save(str(tmp_path / name), {"w": np.ones(2)})
    code, out, _ = _run(capsys, "ls", str(tmp_path))
    assert code == 0
    steps, others = out.split("\n\n")
    assert [line.split()[0] for line in steps.splitlines()] == ["STEP", "1000"]
    assert [line.split()[0] for line in others.splitlines()] == ["NAME", "best", "final"]
    code, out, _ = _run(capsys, "ls", "--json", str(tmp_path))
    listed = json.loads(out)
    assert [s["step"] for s in listed["steps"]] == [1000]
    assert [c["name"] for c in listed["checkpoints"]] == ["best", "final"]


def test_ls_reports_a_damaged_manifest(capsys, root):
    (root / "step_10" / "manifest.json").write_text("{not json")
    code, out, err = _run(capsys, "ls", str(root))
    assert code == 1
    assert "step_2" in out
    assert err.startswith("safepoint: error: step_10: ")


def test_info_human(capsys, ckpt):
    code, out, err = _run(capsys, "info", str(ckpt))
    assert code == 0, err
    summary, table = out.split("\n\n")
    fields = dict(line.split(":", 1) for line in summary.splitlines())
    assert fields["url"].strip() == str(ckpt)
    assert fields["format version"].strip() == "1"
    assert fields["world size"].strip() == "1"
    assert fields["entries"].strip() == "5"
    assert json.loads(fields["metadata"]) == {"epoch": 3}
    assert "1 data file(s)" in fields["size"]
    rows = table.splitlines()
    assert rows[0].split() == ["PATH", "KIND", "DTYPE", "SHAPE", "SIZE", "VALUE"]
    by_path = {row.split()[0]: row for row in rows[1:]}
    assert set(by_path) == {"weights/w", "weights/b", "step", "name", "blob"}
    assert by_path["weights/w"].split() == ["weights/w", "ndarray", "F32", "(3,", "4)", "48", "B"]
    assert by_path["step"].split() == ["step", "value", "-", "-", "-", "7"]
    assert by_path["name"].rstrip().endswith("x...")
    assert len(by_path["name"].split()[-1]) == 40


def test_info_names_what_an_alias_entry_aliases(capsys, tmp_path):
    import torch
    emb = torch.nn.Embedding(4, 2)
    head = torch.nn.Linear(2, 4, bias=False)
    head.weight = emb.weight  # tied: stored once, head.weight an alias of emb.weight
    url = str(tmp_path / "c")
    sp.save(url, {"model": torch.nn.ModuleDict({"emb": emb, "head": head})})
    code, out, _ = _run(capsys, "info", url)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("model/head.weight"))
    assert row.split()[1] == "alias" and row.endswith("same as model/emb.weight")


def test_info_says_an_array_is_big_endian(capsys, tmp_path):
    """info showed a big-endian array as I32 (diff says "I32 big-endian"); sp.info's entries
    and --json now carry the byte order."""
    url = str(tmp_path / "c")
    sp.save(url, {"be": np.arange(3, dtype=">i4"), "le": np.arange(3, dtype="<i4")})
    assert {e.path: e.big_endian for e in sp.info(url).entries} == {"be": True, "le": False}
    code, out, _ = _run(capsys, "info", url)
    assert code == 0
    rows = {line.split()[0]: line.split()[2:4] for line in out.splitlines()
            if line.startswith(("be ", "le "))}
    assert rows == {"be": ["I32", "big-endian"], "le": ["I32", "(3)"]}
    code, out, _ = _run(capsys, "info", "--json", url)
    assert {e["path"]: e["big_endian"] for e in json.loads(out)["entries"]} == {
        "be": True, "le": False}


def test_info_keys_and_limit(capsys, ckpt):
    code, out, _ = _run(capsys, "info", str(ckpt), "--keys", "weights", "--keys", "st*")
    assert code == 0
    paths = [row.split()[0] for row in out.split("\n\n")[1].splitlines()[1:]]
    assert paths == ["weights/w", "weights/b", "step"]

    code, out, _ = _run(capsys, "info", str(ckpt), "--keys", "weights/", "--limit", "1")
    assert code == 0
    rows = out.split("\n\n")[1].splitlines()
    assert [row.split()[0] for row in rows[1:2]] == ["weights/w"]
    assert rows[2] == "... 1 more (raise --limit to see them)"


def test_info_keys_matching_nothing(capsys, ckpt):
    code, out, err = _run(capsys, "info", str(ckpt), "--keys", "optim")
    assert (code, out) == (1, "")
    assert "match nothing" in err


def test_info_json(capsys, ckpt):
    code, out, _ = _run(capsys, "info", "--json", str(ckpt), "--keys", "weights/w", "--keys",
                        "name")
    assert code == 0
    described = json.loads(out)
    saved = sp.info(str(ckpt))
    assert described["url"] == str(ckpt)
    assert described["save_id"] == saved.save_id
    assert described["metadata"] == {"epoch": 3}
    assert described["nbytes"] == saved.nbytes and described["files"] == 1
    assert described["entries"] == [
        {"path": "weights/w", "kind": "ndarray", "dtype": "F32", "shape": [3, 4], "nbytes": 48,
         "value": None, "big_endian": False},
        {"path": "name", "kind": "value", "dtype": None, "shape": None, "nbytes": 0,
         "value": "x" * 100, "big_endian": False},
    ]


def test_info_of_a_torch_training_state(capsys, tmp_path, make_training_state):
    sp.save(str(tmp_path / "c"), make_training_state())
    code, out, _ = _run(capsys, "info", "--json", str(tmp_path / "c"), "--keys", "model/0.weight")
    assert code == 0
    described = json.loads(out)
    assert described["torch_version"] is not None
    assert described["entries"] == [
        {"path": "model/0.weight", "kind": "tensor", "dtype": "F32", "shape": [16, 8],
         "nbytes": 512, "value": None, "big_endian": False},
    ]


def test_info_missing_checkpoint(capsys, tmp_path):
    code, out, err = _run(capsys, "info", str(tmp_path / "missing"))
    assert (code, out) == (1, "")
    assert err.startswith("safepoint: error: no committed checkpoint at")
    assert len(err.splitlines()) == 1


def test_verify_ok(capsys, ckpt, root):
    code, out, err = _run(capsys, "verify", str(ckpt), str(root / "step_10"))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"OK      {ckpt}: ")
    assert lines[1].startswith(f"OK      {root / 'step_10'}: 7.8 KiB in ")
    assert lines[1].endswith("/s)")


def test_verify_finds_corruption(capsys, ckpt, root):
    _flip_byte(ckpt)
    code, out, _ = _run(capsys, "verify", str(root / "step_10"), str(ckpt))
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("OK ")
    assert lines[1].startswith(f"FAILED  {ckpt}: ")
    assert len(lines) > 2 and all(line.startswith("  ") for line in lines[2:])


def test_verify_json(capsys, ckpt, tmp_path):
    code, out, _ = _run(capsys, "verify", "--json", str(ckpt))
    assert code == 0
    (report,) = json.loads(out)["reports"]
    assert report["ok"] and report["problems"] == []
    assert report["nbytes"] == sp.info(str(ckpt)).nbytes and report["seconds"] >= 0

    _flip_byte(ckpt)
    missing = str(tmp_path / "missing")
    code, out, _ = _run(capsys, "verify", "--json", str(ckpt), missing)
    assert code == 1
    result = json.loads(out)
    assert result["ok"] is False
    corrupt, absent = result["reports"]
    assert corrupt["ok"] is False and corrupt["problems"]
    assert absent["url"] == missing and absent["ok"] is False
    assert "no committed checkpoint" in absent["problems"][0]


def test_verify_missing_checkpoint(capsys, tmp_path):
    code, out, _ = _run(capsys, "verify", str(tmp_path / "missing"))
    assert code == 1
    assert out.startswith(f"FAILED  {tmp_path / 'missing'}: 1 problem(s)")


@pytest.mark.parametrize(
    "argv",
    [[], ["frobnicate"], ["ls"], ["verify"], ["info", "x", "--limit", "-1"],
     ["info", "x", "--limit", "many"], ["ls", "x", "--bogus"],
     ["gc", "x", "--keep-every", "0"], ["gc", "x", "--keep-every", "-1"],
     ["gc", "x", "--keep-every-seconds", "nan"], ["gc", "x", "--keep-every-seconds", "-5"]],
)
def test_usage_errors(capsys, argv):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "verify" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["ls", "info", "verify"])
def test_verbose_leaves_logging_as_it_was(capsys, ckpt, command):
    package_logger = logging.getLogger("safepoint")
    handlers, level = list(package_logger.handlers), package_logger.level
    assert main([command, "-v", str(ckpt)]) == 0
    assert (package_logger.handlers, package_logger.level) == (handlers, level)


def test_python_m_safepoint(ckpt):
    done = subprocess.run(
        [sys.executable, "-m", "safepoint", "verify", str(ckpt)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OK ")


def test_the_installed_command(ckpt, tmp_path):
    """The `safepoint` script pip installs (pyproject's [project.scripts]) beside this
    interpreter: exit codes and output as documented."""
    command = Path(sys.executable).with_name("safepoint")
    assert command.is_file(), f"{command} is missing: reinstall with `pip install -e .`"
    done = subprocess.run([str(command), "verify", str(ckpt)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and done.stdout.startswith("OK "), done.stderr
    missing = subprocess.run([str(command), "info", str(tmp_path / "nothing")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 1 and "no committed checkpoint" in missing.stderr
    usage = subprocess.run([str(command), "frobnicate"], capture_output=True, text=True,
                           check=False)
    assert usage.returncode == 2


def test_a_closed_output_pipe_ends_quietly(ckpt):
    """`safepoint info CKPT | head -1`: the command stops when its reader goes away, with
    the shell's status for it and no traceback."""
    command = Path(sys.executable).with_name("safepoint")
    with subprocess.Popen([str(command), "info", str(ckpt)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, bufsize=0) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.read(5)
        proc.stdout.close()  # the table's writes find the pipe closed
        stderr = proc.stderr.read().decode()
        status = proc.wait(timeout=60)
    assert status in (0, 141), stderr
    assert "Traceback" not in stderr, stderr


def test_cli_does_not_import_torch(ckpt, root):
    script = f"""
import sys
import safepoint.cli
assert "torch" not in sys.modules, "import safepoint.cli imported torch"
codes = [
    safepoint.cli.main(["info", {str(ckpt)!r}]),
    safepoint.cli.main(["ls", {str(root)!r}]),
    safepoint.cli.main(["verify", {str(ckpt)!r}]),
]
assert codes == [0, 0, 0], codes
assert "torch" not in sys.modules, "the cli imported torch"
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert done.returncode == 0, done.stderr



# -- cp, and ls/info/verify on remote URLs ---------------------------------------------------------


def _options_json(s3_server: Any) -> str:
    return json.dumps(s3_server.storage_options)


@pytest.mark.filterwarnings("ignore:datetime.datetime.utcnow:DeprecationWarning")
def test_cp_a_root_to_s3_and_back(capsys, root, tmp_path, s3_server, s3_url):
    options = _options_json(s3_server)
    code, out, err = _run(capsys, "cp", str(root), s3_url, "--storage-options", options)
    assert code == 0, err
    assert "copied 2 checkpoint(s)" in out
    assert err == "", "no progress display when stderr is not a terminal"

    code, out, _ = _run(capsys, "ls", s3_url, "--storage-options", options)
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["step_2", "step_10"]
    code, out, _ = _run(capsys, "info", f"{s3_url}/step_2", "--json", "--storage-options",
                        options)
    assert code == 0
    assert json.loads(out)["save_id"] == sp.info(str(root / "step_2")).save_id
    code, out, _ = _run(capsys, "verify", f"{s3_url}/step_2", f"{s3_url}/step_10",
                        "--storage-options", options)
    assert code == 0, out
    assert out.count("OK ") == 2

    back = tmp_path / "back"
    code, out, err = _run(capsys, "cp", s3_url, str(back), "--storage-options", options,
                          "--dst-storage-options", "{}")
    assert code == 0, err
    np.testing.assert_array_equal(sp.load(str(back / "step_2"))["weights"]["w"],
                                  _state()["weights"]["w"])
    code, out, _ = _run(capsys, "cp", s3_url, str(back), "--storage-options", options,
                        "--dst-storage-options", "{}", "--json")
    assert code == 0
    assert json.loads(out)["skipped"] == ["step_10", "step_2"]


def test_cp_of_a_root_names_the_steps_removed_while_it_is_copied(capsys, root, tmp_path,
                                                                monkeypatch):
    """A running job's retention removes a step of the root being copied: the others are
    copied, and the output names the one that vanished, not only --json (found by a
    review)."""

    def retention(self: Any, done: int, total: int) -> None:  # once the copy is planned
        if done == 0 and (root / "step_2").exists():
            shutil.rmtree(root / "step_2")

    monkeypatch.setattr("safepoint.cli._Progress.__call__", retention)
    code, out, err = _run(capsys, "cp", str(root), str(tmp_path / "backup"))
    assert code == 0, err
    assert out.splitlines()[0].startswith("copied 1 checkpoint(s)")
    assert out.splitlines()[1:] == [
        f"note: 1 checkpoint(s) removed from {root} while it was copied (its writer's "
        "retention), not copied: step_2"]


def test_cp_refuses_to_replace_without_overwrite(capsys, ckpt, tmp_path):
    other = tmp_path / "other"
    sp.save(str(other), {"w": np.ones(3)})
    code, _, err = _run(capsys, "cp", str(ckpt), str(other))
    assert code == 1
    assert "overwrite" in err
    np.testing.assert_array_equal(sp.load(str(other))["w"], np.ones(3))
    code, _, err = _run(capsys, "cp", str(ckpt), str(other), "--overwrite")
    assert code == 0, err
    assert sp.load(str(other))["step"] == 7


def test_cp_of_a_corrupt_checkpoint_publishes_nothing(capsys, ckpt, tmp_path):
    _flip_byte(ckpt)
    code, _, err = _run(capsys, "cp", str(ckpt), str(tmp_path / "copy"))
    assert code == 1
    assert "checksum mismatch" in err
    assert not (tmp_path / "copy" / "manifest.json").exists()
    assert not list((tmp_path / "copy").rglob("*.bin")), "the copied data is removed"


def test_cp_shows_progress_on_a_terminal(capsys, ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = _run(capsys, "cp", str(ckpt), str(tmp_path / "copy"))
    assert code == 0
    assert "copying" in err and "/s, ETA" in err and "(100%)" in err


def test_storage_options_must_be_a_json_object(capsys, ckpt):
    code, _, err = _run(capsys, "info", str(ckpt), "--storage-options", "[1]")
    assert code == 2
    assert "JSON object" in err


# --- diff, export, import ---------------------------------------------------------------------


def test_diff_exit_status_and_table(capsys, tmp_path, ckpt):
    code, out, err = _run(capsys, "diff", str(ckpt), str(ckpt))
    assert (code, err) == (0, "")
    assert out.strip() == f"identical: {len(sp.info(str(ckpt)).entries)} entries"

    changed = _state()
    changed["weights"]["w"][0, 0] = 100.0
    changed["step"] = 8
    del changed["blob"]
    sp.save(str(tmp_path / "other"), changed)
    code, out, _ = _run(capsys, "diff", str(ckpt), str(tmp_path / "other"))
    assert code == 1
    lines = out.splitlines()
    assert lines[0].split() == ["PATH", "CHANGE", "DETAIL"]
    assert lines[1].split()[:3] == ["~", "weights/w", "data"]
    assert "max |a-b| 100, 8.33% of 12 elements changed" in lines[1]
    assert lines[2].split() == ["~", "step", "value", "7", "->", "8"]
    assert lines[3].split()[:3] == ["-", "blob", "removed"]
    assert lines[-1] == "3 of 5 entries differ"

    code, out, _ = _run(capsys, "diff", "--json", "--keys", "weights/", str(ckpt),
                        str(tmp_path / "other"))
    assert code == 1
    report = json.loads(out)
    assert report["identical"] is False and report["compared"] == 2
    assert report["differences"] == [{
        "path": "weights/w", "change": "data", "a": "ndarray F32 (3, 4)",
        "b": "ndarray F32 (3, 4)", "max_abs_diff": 100.0, "changed_fraction": 1 / 12,
        "elements": 12,
    }]

    code, _, err = _run(capsys, "diff", str(ckpt), str(tmp_path / "missing"))
    assert code == 1 and "no committed checkpoint" in err


def test_cli_diff_of_pickled_entries_of_different_lengths(capsys, tmp_path):
    """`safepoint diff` of an `sp.Pickled` config that grew between A and B printed numpy's
    broadcast error as a traceback; it is a change of the entry's size, in the table, exit 1."""
    sp.save(str(tmp_path / "a"), {"cfg": sp.Pickled({"layers": 2})})
    sp.save(str(tmp_path / "b"), {"cfg": sp.Pickled({"layers": 2, "heads": 8, "p": 0.1})})
    code, out, err = _run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert (code, err) == (1, "")
    row = out.splitlines()[1].split()
    assert row[:3] == ["~", "cfg", "shape"] and "->" in row
    assert out.splitlines()[-1] == "1 of 1 entries differ"

def test_export_and_import_round_trip(capsys, tmp_path, make_training_state):
    import torch
    state = make_training_state()
    sp.save(str(tmp_path / "ckpt"), state)
    weights = tmp_path / "weights.safetensors"

    code, out, err = _run(capsys, "export", str(tmp_path / "ckpt"), str(weights),
                          "--keys", "model/")
    assert code == 0, err
    assert out.startswith(f"exported 4 entries of {tmp_path / 'ckpt'} to {weights}")

    code, out, err = _run(capsys, "import", "--json", str(weights), str(tmp_path / "back"))
    assert code == 0, err
    assert json.loads(out)["metadata"] == {"imported_from": "weights.safetensors"}
    code, _, _ = _run(capsys, "diff", "--keys", "model/", str(tmp_path / "ckpt"),
                      str(tmp_path / "back"))
    assert code == 0
    code, _, err = _run(capsys, "import", str(weights), str(tmp_path / "back"))
    assert code == 1 and "overwrite" in err
    code, _, _ = _run(capsys, "import", "--overwrite", str(weights), str(tmp_path / "back"))
    assert code == 0

    pickled = tmp_path / "objects.pt"
    torch.save({"w": torch.ones(2), "obj": {1, 2}}, pickled)
    code, _, err = _run(capsys, "import", str(pickled), str(tmp_path / "p"))
    assert code == 1 and "--allow-pickle" in err
    assert not (tmp_path / "p").exists()
    code, _, err = _run(capsys, "import", "--allow-pickle", str(pickled), str(tmp_path / "p"))
    assert code == 0, err
    code, _, err = _run(capsys, "export", str(tmp_path / "p"), str(tmp_path / "p.pt"))
    assert code == 1 and "allow_pickle" in err
    code, _, err = _run(capsys, "export", "--allow-pickle", str(tmp_path / "p"),
                        str(tmp_path / "p.pt"))
    assert code == 0, err
    assert torch.load(tmp_path / "p.pt", weights_only=False)["obj"] == {1, 2}


def test_archive_export_and_import(capsys, tmp_path, make_training_state):
    sp.save(str(tmp_path / "ckpt"), make_training_state(), metadata={"run": "a"})
    archive = tmp_path / "ckpt.tar.gz"
    code, out, err = _run(capsys, "export", str(tmp_path / "ckpt"), str(archive))
    assert code == 0, err
    assert out.startswith(f"exported {len(sp.info(str(tmp_path / 'ckpt')).entries)} entries")
    code, out, err = _run(capsys, "import", "--json", str(archive), str(tmp_path / "back"))
    assert code == 0, err
    assert json.loads(out)["save_id"] == sp.info(str(tmp_path / "ckpt")).save_id
    assert json.loads(out)["metadata"] == {"run": "a"}
    code, _, _ = _run(capsys, "diff", str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert code == 0
    code, _, err = _run(capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "part.tar"),
                        "--keys", "model/")
    assert code == 1 and "whole checkpoint" in err
    (tmp_path / "junk.tar").write_bytes(b"junk" * 1000)
    code, _, err = _run(capsys, "import", str(tmp_path / "junk.tar"), str(tmp_path / "j"))
    assert code == 1 and "not an archive of a safepoint checkpoint" in err
    assert not (tmp_path / "j" / "manifest.json").exists()


def test_diff_runs_without_torch(tmp_path):
    """bf16 tensors saved with torch are compared by a process that cannot import torch."""
    import torch
    a = torch.linspace(-1, 1, 16, dtype=torch.bfloat16)
    b = a.clone()
    b[3] = 5.0
    sp.save(str(tmp_path / "a"), {"x": a})
    sp.save(str(tmp_path / "b"), {"x": b})
    expected = abs(5.0 - a[3].item())
    script = f"""
import sys
sys.modules["torch"] = None  # import torch now fails
import safepoint.cli
code = safepoint.cli.main(["diff", {str(tmp_path / "a")!r}, {str(tmp_path / "b")!r}])
assert code == 1, code
code = safepoint.cli.main(["export", {str(tmp_path / "a")!r}, {str(tmp_path / "a.pt")!r}])
assert code == 1, code
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert done.returncode == 0, done.stderr
    assert f"max |a-b| {expected:.4g}, 6.25% of 16 elements changed" in done.stdout
    assert "torch is not installed" in done.stderr and "pip install torch" in done.stderr


# -- manager roots: ls table and gc ------------------------------------------------------------


@pytest.fixture
def manager_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=2, keep_best=1, best_metric="loss") as mgr:
        for step, loss in [(10, 0.5), (20, 0.9), (30, 0.8), (40, 0.7)]:
            mgr.save(step, {"a": np.full(100, step)}, metrics={"loss": loss})
    return root


def test_ls_manager_root_is_a_step_table(
    manager_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", str(manager_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["STEP", "TIME", "SIZE", "METRICS", "KEPT", "BECAUSE"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert sorted(rows, key=int) == ["10", "30", "40"]
    assert rows["10"].endswith("best") and "loss=0.5" in rows["10"]
    assert rows["40"].endswith("latest, last")
    assert main(["ls", str(manager_root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in listed["steps"]] == [10, 30, 40]
    assert listed["steps"][0]["kept"] == ["best"]


def test_ls_of_a_root_whose_retention_deletes_steps_meanwhile_finds_no_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Steps that the trainer's retention deleted between `ls`'s listing and its reading of
    their manifests are gone, as they should be: they were reported as errors ("no committed
    checkpoint at ...: check the path") with exit 1, a false alarm for a monitor polling
    `ls` during training."""
    from safepoint._storage_local import LocalStorage
    from safepoint.storage import _REGISTERED

    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False, keep_last=3) as trainer:
        for step in (1, 2, 3):
            trainer.save(step, {"w": np.full(8, float(step))})
    calls: list[str] = []

    class TrainerSavesAfterTheListing(LocalStorage):
        def exists(self, path: str) -> bool:
            found = super().exists(path)
            if path == "step-3/manifest.json":  # ls found the steps: they are listed
                calls.append(path)
                with sp.CheckpointManager(str(root), async_save=False, keep_last=1) as later:
                    later.save(4, {"w": np.full(8, 4.0)})
            return found

    monkeypatch.setitem(_REGISTERED, "pruned",
                        lambda url, options: TrainerSavesAfterTheListing(url.partition("://")[2]))
    assert main(["ls", f"pruned://{root}"]) == 0
    captured = capsys.readouterr()
    assert calls and captured.err == ""
    assert [line.split()[0] for line in captured.out.splitlines()[1:]] == []


def test_ls_of_a_manager_root_names_uncommitted_leftovers(
    manager_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (manager_root / "step-90" / "data").mkdir(parents=True)
    (manager_root / "step-90" / "data" / f"{uuid.uuid4().hex}-r00000-0000.bin").write_bytes(b"x")
    code, out, _ = _run(capsys, "ls", str(manager_root))
    assert code == 0
    assert "1 uncommitted leftover(s)" in out and "step-90" in out
    code, out, _ = _run(capsys, "ls", "--json", str(manager_root))
    assert code == 0
    assert json.loads(out)["uncommitted"] == [{"name": "step-90", "files": 1}]


def test_ls_names_every_leftover_gc_would_remove(
    manager_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step directory without a manifest whose files are not named as safepoint names its
    own: `gc --dry-run` said it would delete it, `ls` did not show it. Both count its files."""
    (manager_root / "step-60" / "data").mkdir(parents=True)
    (manager_root / "step-60" / "data" / "x.bin").write_bytes(b"abc")
    (manager_root / "step-60" / "notes.txt").write_text("n")
    code, out, _ = _run(capsys, "ls", "--json", str(manager_root))
    assert code == 0
    assert json.loads(out)["uncommitted"] == [{"name": "step-60", "files": 2}]
    code, out, _ = _run(capsys, "gc", "--dry-run", "--json", str(manager_root))
    assert json.loads(out)["leftovers"] == {"60": ["step-60/data/x.bin", "step-60/notes.txt"]}


def _damaged_root(tmp_path: Path, damaged: int) -> Path:
    """Steps 1 to 5 saved with keep_every=2 and keep_last=10 (all kept), one manifest damaged."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=10, keep_every=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"a": np.full(3, step)})
    (root / f"step-{damaged}" / "manifest.json").write_text("garbage")
    return root


def test_gc_works_when_the_newest_step_is_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The policy is the one the newest readable step recorded; flags still override it; the
    damaged step is named and left in place, and the exit status says a problem was found."""
    root = _damaged_root(tmp_path, damaged=5)
    code, out, _ = _run(capsys, "gc", str(root), "--dry-run", "--json")
    assert code == 1
    report = json.loads(out)
    assert "every" in report["kept"]["2"] and "every" in report["kept"]["4"]  # step 4's policy
    assert report["deleted_steps"] == []
    assert [u["step"] for u in report["unreadable"]] == [5]
    code, out, err = _run(capsys, "gc", str(root), "--keep-last", "1")
    assert code == 1
    assert "deleted step 1" in out and "deleted step 3" in out
    assert "step 5 is unreadable, so gc left it in place" in err and "safepoint verify" in err
    assert sorted(p.name for p in root.glob("step-*")) == ["step-2", "step-4", "step-5"]


def test_gc_reports_a_damaged_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _damaged_root(tmp_path, damaged=3)
    code, out, err = _run(capsys, "gc", str(root), "--dry-run")
    assert code == 1
    assert "step 3 is unreadable" in err and "step-3/manifest.json" in err
    assert "kept step 5" in out
    code, out, _ = _run(capsys, "gc", str(root), "--dry-run", "--json")
    assert code == 1
    (damaged,) = json.loads(out)["unreadable"]
    assert damaged["step"] == 3 and "not valid JSON" in damaged["error"]



def test_ls_json_of_a_root_with_a_damaged_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step whose manifest cannot be read is named in `unreadable` as any other unreadable
    checkpoint is (name and error; plus its step number, as `gc --json` gives it), not as a
    bare string."""
    root = _damaged_root(tmp_path, damaged=3)
    (root / "other").mkdir()
    (root / "other" / "manifest.json").write_text("garbage")
    code, out, err = _run(capsys, "ls", "--json", str(root))
    assert code == 1
    listing = json.loads(out)
    assert [s["step"] for s in listing["steps"]] == [1, 2, 4, 5]
    damaged, other = listing["unreadable"]
    assert damaged["name"] == "step-3" and damaged["step"] == 3
    assert "not valid JSON" in damaged["error"]
    assert other["name"] == "other" and "not valid JSON" in other["error"]
    assert "step-3: " in err and "other: " in err

def test_gc_dry_run_then_for_real(manager_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    leftover = manager_root / "step-50" / "data" / "x.bin"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"x")
    assert main(["gc", str(manager_root), "--keep-last", "1", "--keep-best", "0",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete step 10" in out and "would delete step 30" in out
    assert "would delete leftover step-50" in out
    assert sp.CheckpointManager(str(manager_root)).steps() == [10, 30, 40]
    assert leftover.exists()
    assert main(["gc", str(manager_root), "--keep-last", "1", "--keep-best", "0"]) == 0
    assert sp.CheckpointManager(str(manager_root)).steps() == [40]
    assert not leftover.exists()


def test_ls_and_gc_of_a_manager_root_on_s3(capsys, s3_server, s3_url):
    options = s3_server.storage_options
    with sp.CheckpointManager(s3_url, keep_last=3, storage_options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"a": np.full(10, step)})
    flags = ["--storage-options", _options_json(s3_server)]
    code, out, _ = _run(capsys, "ls", s3_url, "--json", *flags)
    assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == [1, 2, 3]
    code, out, _ = _run(capsys, "gc", s3_url, "--keep-last", "1", *flags)
    assert code == 0 and "step 1" in out and "step 2" in out
    assert sp.CheckpointManager(s3_url, storage_options=options).steps() == [3]
    assert sp.load(f"{s3_url}/step-3", storage_options=options)["a"].tolist() == [3] * 10


def test_gc_refuses_a_root_being_written(
    manager_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sp.CheckpointManager(str(manager_root)) as writer:
        writer.save(50, {"a": np.ones(3)})
        assert main(["gc", str(manager_root)]) == 1
    assert "one writer per root" in capsys.readouterr().err


def test_diff_json_reports_an_infinite_difference_as_the_manifest_spells_it(capsys, tmp_path):
    sp.save(str(tmp_path / "a"), {"x": np.array([1.0, 2.0])})
    sp.save(str(tmp_path / "b"), {"x": np.array([1.0, np.nan])})
    code, out, _ = _run(capsys, "diff", "--json", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1
    (change,) = json.loads(out)["differences"]
    assert (change["max_abs_diff"], change["changed_fraction"]) == ({"float": "inf"}, 0.5)


def _strict_json(text: str) -> Any:
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_json_output_is_strict_json_with_infinite_values(tmp_path: Path, capsys: Any) -> None:
    """A stored `best_loss = inf` is printed as {"float": "inf"} (jq and JSON.parse refuse
    Infinity)."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"best_loss": float("inf"), "last_loss": float("nan")})
    assert main(["info", "--json", url]) == 0
    printed = _strict_json(capsys.readouterr().out)
    values = {e["path"]: e["value"] for e in printed["entries"]}
    assert values == {"best_loss": {"float": "inf"}, "last_loss": {"float": "nan"}}
    sp.export_checkpoint(url, tmp_path / "c.tar")
    assert main(["import", "--json", str(tmp_path / "c.tar"), str(tmp_path / "imp")]) == 0
    _strict_json(capsys.readouterr().out)


def test_gc_of_a_path_holding_nothing_or_not_a_root_creates_nothing(
    tmp_path: Path, capsys: Any
) -> None:
    missing = tmp_path / "no-such-root"
    assert main(["gc", str(missing)]) == 1
    assert not missing.exists()
    assert "nothing under" in capsys.readouterr().err
    one = tmp_path / "ckpt"
    sp.save(str(one), {"x": 1})
    assert main(["gc", str(one)]) == 1
    assert "one checkpoint, not a manager root" in capsys.readouterr().err
    assert not (one / "lease").exists()
    leftover = tmp_path / "crashed"  # a single checkpoint's save that never committed
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / f"{uuid.uuid4().hex}-r00000-0000.bin").write_bytes(b"x" * 100)
    assert main(["gc", str(leftover)]) == 1
    assert "holds no step-N directories" in capsys.readouterr().err
    assert sorted(p.name for p in leftover.iterdir()) == ["data"]


def test_info_json_with_deeply_nested_metadata_does_not_crash(capsys, ckpt):
    """Metadata 700 dicts deep, which the manifest decoder accepts, prints as JSON: no
    RecursionError out of `main` from deep-copying it (found by a review)."""
    deep: Any = 1
    for _ in range(700):
        deep = {"k": deep}
    manifest = ckpt / "manifest.json"
    document = json.loads(manifest.read_text())
    del document["manifest_checksum"]
    document["metadata"] = {"x": deep}
    manifest.write_bytes(seal(json.dumps(document, separators=(",", ":")).encode()))
    assert sp.info(str(ckpt)).metadata["x"]["k"]["k"]["k"]["k"]
    code, out, err = _run(capsys, "info", "--json", str(ckpt))
    assert (code, err) == (0, "")
    printed = json.loads(out)["metadata"]["x"]
    for _ in range(700):
        printed = printed["k"]
    assert printed == 1


def test_safepoint_cp_of_a_checkpoint_missing_a_data_file_exits_with_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`safepoint cp SRC DST` where SRC lost a data file.

    The CLI prints an error naming the missing file and exits 1 (a FileNotFoundError used to
    escape main() as a traceback)."""
    src = tmp_path / "src"
    sp.save(str(src), _state())
    for path in (src / "data").iterdir():
        path.unlink()
    status = main(["cp", str(src), str(tmp_path / "dst")])
    assert status == 1
    err = capsys.readouterr().err
    assert "safepoint: error" in err and "is missing" in err


def _command(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "safepoint", *argv], capture_output=True,
                          check=False, timeout=60, env={**os.environ, **(env or {})})


def test_info_json_with_limit_says_how_many_entries_it_left_out(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The text says `... N more`; the JSON gave the first entries and no count, so a script
    could not tell a cut listing from a whole one."""
    code, out, _ = _run(capsys, "info", str(ckpt), "--limit", "1", "--json")
    described = json.loads(out)
    assert code == 0 and len(described["entries"]) == 1
    assert described["entries_left_out"] == len(sp.info(str(ckpt)).entries) - 1


@pytest.mark.parametrize("flags", [
    ["--keep-every-seconds", "inf"],
    ["--keep-every-seconds", "1e400"],
    ["--keep-best", "1"],  # no --best-metric, and the root recorded none
])
def test_gc_flag_values_refused_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    """`nan` and `-5` exited 2; these exited 1, as a problem found would."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(1, {"a": np.ones(2)})
    code, _, err = _run(capsys, "gc", str(root), "--dry-run", *flags)
    assert code == 2, err
    assert (root / "step-1" / "manifest.json").exists()


def test_a_path_that_is_not_utf8_prints_as_its_bytes(tmp_path: Path) -> None:
    """Under a UTF-8 locale, `ls` and `info` of a checkpoint named b'caf\\xe9' (from a
    Latin-1 host) died with a UnicodeEncodeError traceback."""
    name = os.fsdecode(b"caf\xe9")
    sp.save(str(tmp_path / name), {"w": np.ones(3)})
    for argv in (["ls", str(tmp_path)], ["info", str(tmp_path / name)]):
        done = _command(*argv, env={"PYTHONIOENCODING": "utf-8"})
        assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
        assert b"caf\xe9" in done.stdout


@pytest.mark.parametrize("suffix", [".safetensors", ".tar"])
def test_import_into_a_link_to_nowhere_is_a_one_line_error_naming_it(
    tmp_path: Path, suffix: str
) -> None:
    """A checkpoint path that links to a scratch disk not mounted: the import died with a
    FileNotFoundError traceback (the write took a directory it could not make for a missing
    file), and an archive's was blamed on the archive ("damaged ... make it again")."""
    sp.save(str(tmp_path / "c"), {"w": np.ones(3)})
    sp.export_checkpoint(str(tmp_path / "c"), str(tmp_path / f"m{suffix}"))
    (tmp_path / "dangling").symlink_to(tmp_path / "unmounted" / "run1")
    done = _command("import", str(tmp_path / f"m{suffix}"), str(tmp_path / "dangling"))
    assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(b"safepoint: error:") and b"dangling" in done.stderr
    assert b"archive" not in done.stderr and b"not mounted" in done.stderr


def test_warnings_print_a_line_each_without_verbose(tmp_path: Path) -> None:
    """A warning logged with its exception (a file it could not remove) reached Python's
    last-resort handler: 40 lines of tracebacks before the one-line error."""
    sp.save(str(tmp_path / "c"), {"w": np.ones(3)})
    sp.export_checkpoint(str(tmp_path / "c"), str(tmp_path / "m.safetensors"))
    faulty_disk = textwrap.dedent("""
        import sys
        from safepoint import StorageError
        from safepoint._storage_local import LocalStorage
        from safepoint.cli import main

        def broken(self, *args, **kwargs):
            raise StorageError(f"{self.url}: input/output error")

        LocalStorage.write = LocalStorage.delete = broken
        sys.exit(main(sys.argv[1:]))
    """)
    argv = ["import", str(tmp_path / "m.safetensors"), str(tmp_path / "d")]
    done = subprocess.run([sys.executable, "-c", faulty_disk, *argv], capture_output=True,
                          timeout=60)
    assert done.returncode == 1 and b"safepoint: warning: could not remove" in done.stderr
    assert b"Traceback" not in done.stderr and done.stderr.count(b"\n") == 2, done.stderr
    verbose = subprocess.run([sys.executable, "-c", faulty_disk, *argv, "-v"],
                             capture_output=True, timeout=60)
    assert b"Traceback" in verbose.stderr


def test_ls_names_a_killed_overwrites_data_in_a_committed_step_as_gc_does(
    manager_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (data,) = (manager_root / "step-40" / "data").glob("*.bin")
    stray = manager_root / "step-40" / "data" / f"{uuid.uuid4().hex}-r00000-0000.bin"
    stray.write_bytes(data.read_bytes())
    code, out, _ = _run(capsys, "gc", str(manager_root), "--dry-run")
    assert code == 0 and "would delete leftover step-40" in out
    code, out, _ = _run(capsys, "ls", str(manager_root), "--json")
    listed = json.loads(out)
    assert code == 0 and listed["stray"] == [{"name": "step-40", "files": 1}]
    assert listed["uncommitted"] == [] and 40 in [s["step"] for s in listed["steps"]]
    # The note called the committed step a directory without a manifest, never committed:
    # one who believed it and removed the directory deleted a checkpoint.
    code, out, _ = _run(capsys, "ls", str(manager_root))
    (note,) = [line for line in out.splitlines() if "step-40" in line]
    assert "without a manifest" not in note and "gc" in note and "step-40 (1)" in note


def _failing_overwrite(url: str, monkeypatch: pytest.MonkeyPatch,
                       options: dict[str, Any] | None = None) -> None:
    """An overwrite of the checkpoint at `url` whose publish fails, and the removal of its
    data file too: that file stays beside the committed manifest."""
    from safepoint.storage import _REGISTERED, open_storage

    def failing(url: str, options: dict[str, Any] | None = None) -> FaultyStorage:
        return FaultyStorage(open_storage(url.removeprefix("failing+"), options),
                             lambda op, path, n: op in ("publish", "delete"))

    monkeypatch.setitem(_REGISTERED, "failing+s3", failing)
    monkeypatch.setitem(_REGISTERED, "failing+file", failing)
    target = url if "://" in url else f"file://{url}"
    with pytest.raises(sp.StorageError, match="injected"):
        sp.save(f"failing+{target}", {"w": np.ones(100)}, overwrite=True,
                storage_options=options)


def test_ls_of_a_checkpoint_names_what_a_failed_overwrite_left_beside_it(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ls CKPT` of one checkpoint named what a killed or failed overwrite left in it only
    for a manager's steps: for a plain checkpoint it returned once the manifest was read."""
    _failing_overwrite(str(ckpt), monkeypatch)
    code, out, _ = _run(capsys, "ls", str(ckpt), "--json")
    listed = json.loads(out)
    assert code == 0 and listed["stray"] == [{"name": str(ckpt), "files": 1}]
    assert [c["url"] for c in listed["checkpoints"]] == [str(ckpt)]
    assert listed["uncommitted"] == []
    code, out, _ = _run(capsys, "ls", str(ckpt))
    note = out.splitlines()[-1]
    assert code == 0 and f"{ckpt} (1)" in note and "overwrite" in note
    assert "without a manifest" not in out
    assert sp.load(str(ckpt))["step"] == 7  # the committed checkpoint is the old one


def test_ls_of_a_checkpoint_on_s3_names_a_failed_and_a_killed_overwrites_leftovers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, s3_server: Any,
    s3_url: str,
) -> None:
    """On S3 the listing holds a failed overwrite's data object, and the multipart upload a
    killed one left open (which no listing of objects shows: the storage lists it as the
    file it was to be)."""
    options = s3_server.storage_options
    sp.save(s3_url, _state(), storage_options=options)
    _failing_overwrite(s3_url, monkeypatch, options)
    killed = textwrap.dedent("""
        import json, os, sys
        import numpy as np
        import safepoint as sp
        from safepoint import storage
        from safepoint._storage_fsspec import FsspecStorage
        from safepoint.testing import FaultyStorage

        def kill(op, path, n):  # the third chunk of 8 MiB is in the upload's second part
            if op == "write_chunk" and n == 3:
                os._exit(9)
            return False

        storage.register("s3", lambda url, options=None: FaultyStorage(
            FsspecStorage(url, options, part_bytes=5 << 20), kill))
        sp.save(sys.argv[1], {"w": np.zeros(3 << 20)}, overwrite=True,
                storage_options=json.loads(sys.argv[2]))
    """)
    done = subprocess.run([sys.executable, "-c", killed, s3_url, _options_json(s3_server)],
                          capture_output=True, timeout=120)
    assert done.returncode == 9, done.stderr
    import s3fs

    client = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    uploads = client.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    assert len(uploads.get("Uploads", [])) == 1
    code, out, _ = _run(capsys, "ls", s3_url, "--json", "--storage-options",
                        _options_json(s3_server))
    listed = json.loads(out)
    assert code == 0 and listed["stray"] == [{"name": s3_url, "files": 2}]
    assert [c["url"] for c in listed["checkpoints"]] == [s3_url]


def test_ctrl_c_stops_a_command_with_one_line_and_130(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt (a long verify, copy or export stopped by Ctrl-C) escaped main:
    the interpreter printed its traceback."""

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(sp, "verify", interrupted)
    code, out, err = _run(capsys, "verify", str(ckpt))
    assert code == 130 and err == "safepoint: error: interrupted\n" and out == ""


def test_ls_of_a_manager_root_reads_each_steps_manifest_once(
    manager_root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step table and the leftover scan read every manifest apiece (twice the GETs on an
    object store, twice the parsing of large manifests)."""
    from safepoint import _commit

    paths: list[str] = []

    def counting(storage: Any, *args: Any, **kwargs: Any) -> Any:
        if "/step-" in storage.url:
            paths.append(storage.url)
        return _commit.read_manifest(storage, *args, **kwargs)

    for module in ("safepoint._api", "safepoint._manager"):
        monkeypatch.setattr(f"{module}.read_manifest", counting)
    code, out, _ = _run(capsys, "ls", str(manager_root), "--json")
    steps = [s["step"] for s in json.loads(out)["steps"]]
    assert code == 0 and len(steps) > 1
    assert sorted(paths) == sorted(set(paths)) and len(paths) == len(steps), paths


def test_ls_json_gives_every_url_in_the_form_the_root_was_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps' URLs came out absolute (the manager's root), the rest as given."""
    monkeypatch.chdir(tmp_path)
    with sp.CheckpointManager("run", async_save=False) as mgr:
        mgr.save(3, {"a": np.ones(2)})
    sp.save("run/final", {"a": np.ones(2)})
    code, out, _ = _run(capsys, "ls", "run", "--json")
    listed = json.loads(out)
    assert code == 0 and listed["url"] == "run"
    assert [s["url"] for s in listed["steps"]] == ["run/step-3"]
    assert [c["url"] for c in listed["checkpoints"]] == ["run/final"]


def test_main_in_process_leaves_stdout_as_it_found_it(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths that are not UTF-8 print as their bytes while the command runs; a program that
    called `main` kept stdout writing lone surrogates as invalid UTF-8 after it returned."""
    import io

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["ls", str(ckpt.parent)]) == 0
    assert out.errors == "strict"


def test_gc_with_stdout_closed_does_its_work_and_exits_0(manager_root: Path) -> None:
    """`safepoint gc ROOT >&-` (a cron job with stdout closed): gc deleted the steps, then
    the flush of `sys.stdout`, None, raised AttributeError: a traceback and exit 1."""
    done = subprocess.run(
        [sys.executable, "-m", "safepoint", "gc", str(manager_root), "--keep-last", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False, timeout=60,
        preexec_fn=lambda: os.close(1),
    )
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    kept = sorted(p.name for p in manager_root.iterdir() if p.name.startswith("step-"))
    assert kept == ["step-10", "step-40"]  # the newest, and the best by loss


@pytest.mark.parametrize("command", [["info", "CKPT"], ["--help"], ["--version"],
                                     ["ls", "--help"]], ids=" ".join)
def test_output_to_a_full_disk_is_a_one_line_error(ckpt: Path, command: list[str]) -> None:
    """`safepoint info CKPT > /dev/full`: print's OSError escaped as a traceback; `safepoint
    --help > /dev/full` exited 0 and said nothing (argparse drops the write's error)."""
    assert os.path.exists("/dev/full"), "this test needs Linux's /dev/full (ENOSPC on write)"
    argv = [str(ckpt) if word == "CKPT" else word for word in command]
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "safepoint", *argv],
                              stdout=full, stderr=subprocess.PIPE, check=False, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(b"safepoint: error: cannot write output: ")
    assert done.stderr.rstrip().endswith(b"free space where it goes, or send it elsewhere")
    assert b"No space left" in done.stderr and done.stderr.count(b"\n") == 1, done.stderr


def test_ls_sorts_a_name_with_a_digit_that_is_not_decimal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sibling named `ckpt-1²` ("²" is a digit to str.isdigit, not to int) made the
    natural sort raise ValueError: no listing at all."""
    for name in ("ckpt-10", "ckpt-1\u00b2", "ckpt-2"):
        sp.save(str(tmp_path / name), {"w": np.zeros(2)})
    code, out, err = _run(capsys, "ls", "--json", str(tmp_path))
    assert code == 0, err
    names = [c["name"] for c in json.loads(out)["checkpoints"]]
    assert names == ["ckpt-1\u00b2", "ckpt-2", "ckpt-10"]


def test_info_on_an_ascii_stdout_escapes_what_it_cannot_spell(tmp_path: Path) -> None:
    """A key the output's encoding cannot spell (a snowman on an ASCII stdout) crashed `info`
    midway with UnicodeEncodeError; a path that is not UTF-8 still prints as its bytes."""
    url = tmp_path / os.fsdecode(b"caf\xe9")
    sp.save(str(url), {"emb\u2603": np.zeros(2), "step": 1}, metadata={"\u5b57": 1})
    done = _command("info", str(url), env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    assert b"emb\\u2603" in done.stdout and b"\\u5b57" in done.stdout
    assert b"caf\xe9" in done.stdout and b"step" in done.stdout


def test_info_json_spells_non_finite_floats_as_the_manifest_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A float NaN came out as the string "nan", the same as the str value "nan", and a NaN
    of another sign or payload lost its bits."""
    url = str(tmp_path / "ckpt")
    other_nan = -float("nan")
    sp.save(url, {"lr": float("nan"), "tag": "nan", "best": float("-inf"), "name": "-inf",
                  "odd": other_nan})
    code, out, _ = _run(capsys, "info", "--json", url)
    values = {e["path"]: e["value"] for e in _strict_json(out)["entries"]}
    assert code == 0
    assert values == {"lr": {"float": "nan"}, "tag": "nan", "best": {"float": "-inf"},
                      "name": "-inf", "odd": {"float": "nan", "bits": "fff8000000000000"}}


def _too_deep_for_a_path(top: Path) -> None:
    """Directories under `top` whose innermost path is longer than PATH_MAX (4096), made by
    descending with relative names, as any tool working in place can: nothing can list them
    by path, as another user's private folder cannot be listed on a shared disk."""
    here = os.getcwd()
    top.mkdir(parents=True)
    os.chdir(top)
    try:
        for _ in range(25):
            os.mkdir("d" * 200)
            os.chdir("d" * 200)
        Path("notes.txt").touch()
    finally:
        os.chdir(here)


def test_ls_lists_nothing_deeper_than_what_it_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ls DIR` listed every file under DIR (so it walked every run of /shared/ckpts), and a
    directory deep under a sibling that could not be listed failed the whole command with
    nothing listed. Now only DIR, its directories and their data/ are listed; one of them
    that cannot be listed is named in a warning and "skipped", and the rest is listed."""
    from safepoint._storage_local import LocalStorage

    sp.save(str(tmp_path / "ck"), {"w": np.zeros(2)})
    _too_deep_for_a_path(tmp_path / "notes")
    _too_deep_for_a_path(tmp_path / "crashed" / "data")
    sp.save(str(tmp_path / "leftover"), {"w": np.zeros(2)})
    (tmp_path / "leftover" / "manifest.json").unlink()
    (tmp_path / "step-1\u00b2").mkdir()  # not a step: "²" is no decimal digit
    listed: list[str] = []
    whole = LocalStorage.list

    def recording(self: LocalStorage, prefix: str = "") -> list[str]:
        listed.append(prefix)
        return whole(self, prefix)

    monkeypatch.setattr(LocalStorage, "list", recording)
    code, out, err = _run(capsys, "ls", "--json", str(tmp_path))
    found = json.loads(out)
    assert code == 0, err
    assert [c["name"] for c in found["checkpoints"]] == ["ck"]
    assert found["uncommitted"] == [{"name": "leftover", "files": 1}]
    assert [s["name"] for s in found["skipped"]] == ["crashed"] and found["unreadable"] == []
    assert err.startswith("safepoint: warning: skipped crashed") and err.count("\n") == 1
    assert listed and all(prefix.endswith("data") for prefix in listed), listed
    code, out, err = _run(capsys, "ls", str(tmp_path))
    assert code == 0 and out.splitlines()[1].split()[0] == "ck" and "leftover" in out


def test_ls_skips_a_folder_it_may_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's private folder beside the checkpoints (its manifest.json, if any,
    unreadable for want of permission) failed `ls` with exit 1, though README says such a
    folder is skipped (found by a review). Tests run as root, so the denial is injected."""
    from safepoint._storage_local import LocalStorage

    sp.save(str(tmp_path / "ck"), {"w": np.zeros(2)})
    (tmp_path / "private").mkdir()
    opened = LocalStorage._open_file

    def denied(self: LocalStorage, path: str) -> int:
        if os.path.basename(self.root) == "private":
            raise PermissionError(13, "Permission denied", self._full(path))
        return opened(self, path)

    monkeypatch.setattr(LocalStorage, "_open_file", denied)
    code, out, err = _run(capsys, "ls", "--json", str(tmp_path))
    found = json.loads(out)
    assert code == 0, err
    assert [c["name"] for c in found["checkpoints"]] == ["ck"]
    assert [s["name"] for s in found["skipped"]] == ["private"] and found["unreadable"] == []
    assert err.startswith("safepoint: warning: skipped private")


def test_ls_on_an_object_store_lists_directories_directly_under(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fsspec's delimited listing: checkpoints and leftovers directly under a URL, nothing
    from the trees below them."""
    url = f"memory://ls-{uuid.uuid4().hex}"
    sp.save(f"{url}/a", {"w": np.zeros(2)})
    sp.save(f"{url}/runs/deep/b", {"w": np.zeros(2)})
    sp.save(f"{url}/crashed", {"w": np.zeros(2)})
    sp.save(f"{url}/leftover", {"w": np.zeros(2)})
    storage = sp.storage.open_storage(f"{url}/leftover")
    storage.delete(["manifest.json"])
    assert storage.children("") == ([], ["data"])  # type: ignore[attr-defined]
    with pytest.raises(FileNotFoundError):
        storage.children("nothing")  # type: ignore[attr-defined]
    code, out, err = _run(capsys, "ls", "--json", url)
    found = json.loads(out)
    assert code == 0, err
    assert [c["name"] for c in found["checkpoints"]] == ["a", "crashed"]
    assert found["uncommitted"] == [{"name": "leftover", "files": 1}]


def test_cli_export_of_big_endian_array_is_no_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`safepoint export` of a checkpoint holding a big-endian array to .pt printed the
    traceback of torch's ValueError ("byte order different from the native byte order"):
    it exports, the values in native byte order."""
    import torch
    emb = np.arange(6, dtype=">f4").reshape(2, 3)
    sp.save(str(tmp_path / "ckpt"), {"emb": emb})
    code, _, err = _run(capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"))
    assert code == 0, err
    assert np.array_equal(torch.load(tmp_path / "out.pt", weights_only=True)["emb"].numpy(), emb)


def test_gc_of_a_directory_whose_names_merely_start_with_step_dash_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory of ordinary checkpoints named `step-best` and `step-final` (and a file
    `step-by-step.md`) holds no step-N directory: gc should refuse it as it refuses any
    other non-root ("holds no step-N directories", exit 1) and create nothing. It took the
    writer lease instead (a `lease/` directory appeared in the user's folder) and exited 0,
    as if it had collected a manager root."""
    folder = tmp_path / "exports"
    sp.save(str(folder / "step-best"), {"w": np.ones(3)})
    sp.save(str(folder / "step-final"), {"w": np.ones(3)})
    (folder / "step-by-step.md").write_text("notes")
    code, _, err = _run(capsys, "gc", str(folder))
    assert code == 1
    assert "holds no step-N directories" in err
    assert sorted(p.name for p in folder.iterdir()) == [
        "step-best", "step-by-step.md", "step-final"]


def test_ls_of_a_manager_root_skips_a_step_directory_it_may_not_look_into(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: `ls` "names one [directory] it cannot look into in a warning ("skipped" in
    --json), exit status unchanged". A step directory of a shared root that the user may not
    enter (another user's umask 077; injected, since tests run as root) made `ls ROOT` fail
    as a whole: one error line ("looking for .../step-2/manifest.json failed: Permission
    denied"), exit 1, and no table of the steps it can read."""
    from safepoint._storage_local import LocalStorage
    from safepoint.storage import mapped_errors


    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full(4, float(step))})
    private = str(root / "step-2")
    exists = LocalStorage.exists

    def denied(self: LocalStorage, path: str) -> bool:
        full = os.path.join(self.root, path)
        if full.startswith(private + os.sep):
            with mapped_errors(self._where(path), "looking for"):
                raise PermissionError(13, "Permission denied", full)
        return exists(self, path)

    monkeypatch.setattr(LocalStorage, "exists", denied)
    code, out, err = _run(capsys, "ls", "--json", str(root))
    assert code == 0, err
    listed = json.loads(out)
    assert [s["step"] for s in listed["steps"]] == [1, 3]
    assert [s["name"] for s in listed["skipped"]] == ["step-2"]
    assert err.startswith("safepoint: warning: skipped step-2")


# -- output a checkpoint cannot forge, progress lines, sizes, gc's metric ---------------------

#: Entry paths that, printed raw, clear the screen and forge a line of `verify`'s output.
_HOSTILE = {"model\x1b[2J\x1b[31mPWNED": np.zeros(2), "fake\nOK      c1: all good": 1}


def test_text_output_escapes_control_characters_of_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Entry paths and checkpoint names from a checkpoint were printed raw by `info`, `diff`
    and `ls`: an ESC sequence reached the terminal and a newline split a row to forge a line
    (found by a review). The text output shows them as their escapes; --json keeps them
    exact."""
    run = tmp_path / "run"
    hostile = run / "ck\x1b[31m\npt"
    sp.save(str(hostile), _HOSTILE)
    sp.save(str(run / "plain"), {"w": np.zeros(2)})
    escaped = ["model\\x1b[2J\\x1b[31mPWNED", "fake\\nOK      c1: all good"]
    for argv in (["info", str(hostile)], ["diff", str(run / "plain"), str(hostile)]):
        _, out, err = _run(capsys, *argv)
        assert "\x1b" not in out + err and "\nOK" not in out, argv
        assert all(path in out for path in escaped), out
        assert "ck\\x1b[31m\\npt" in out or argv[0] == "diff"
    _, out, err = _run(capsys, "ls", str(run))
    assert "\x1b" not in out + err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["ck\\x1b[31m\\npt", "plain"]

    _, out, _ = _run(capsys, "info", "--json", str(hostile))
    assert sorted(e["path"] for e in json.loads(out)["entries"]) == sorted(_HOSTILE)
    _, out, _ = _run(capsys, "diff", "--json", str(run / "plain"), str(hostile))
    assert set(_HOSTILE) <= {d["path"] for d in json.loads(out)["differences"]}
    _, out, _ = _run(capsys, "ls", "--json", str(run))
    assert json.loads(out)["checkpoints"][0]["name"] == hostile.name


def test_a_metric_name_and_a_failed_verify_print_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A metric's name in `ls`'s step table, and a problem line of `verify` (naming a data file
    of a checkpoint whose name holds an ESC), are shown escaped too."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(1, {"w": np.zeros(2)}, metrics={"lo\x1bss": 0.5})
    code, out, _ = _run(capsys, "ls", str(root))
    assert code == 0 and "\x1b" not in out and "lo\\x1bss=0.5" in out
    ckpt = tmp_path / "c\x1b[2Jk"
    sp.save(str(ckpt), {"w": np.zeros(4)})
    for data in (ckpt / "data").iterdir():
        data.write_bytes(b"")
    code, out, err = _run(capsys, "verify", str(ckpt))
    assert code == 1 and "\x1b" not in out + err
    assert out.startswith(f"FAILED  {tmp_path}/c\\x1b[2Jk: 1 problem(s)")


class _Terminal(io.StringIO):
    """stdout and stderr as one terminal shows them: interleaved, and a tty."""

    def isatty(self) -> bool:
        return True


def _truncated(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), {"w": np.ones(100_000)})
    for data in (ckpt / "data").iterdir():
        os.truncate(data, 100)
    return ckpt


@pytest.mark.parametrize("command", ["verify", "cp"])
def test_a_failed_command_ends_its_progress_line_before_it_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """A `verify` or `cp` that failed before 100% left its progress line open on a terminal,
    and the result (`FAILED  ...`, or the error) was glued onto it: `\\r verifying ...
    (0%) ...\\x1b[KFAILED` (found by a review). Every progress line now ends before what
    follows."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    ckpt = _truncated(tmp_path)
    argv = [command, str(ckpt)] + ([str(tmp_path / "copy")] if command == "cp" else [])
    assert main(argv) == 1
    shown = terminal.getvalue()
    assert "(0%)" in shown, "a progress line was drawn"
    drawn = shown.split("\x1b[K")
    assert all(after.startswith(("\r", "\n")) for after in drawn[1:]), repr(shown)
    assert shown.endswith("\n")
    assert ("\nFAILED  " if command == "verify" else "\nsafepoint: error: ") in shown


def test_human_bytes_never_prints_1024_of_a_unit() -> None:
    """1048575 bytes printed as "1024.0 KiB": a value rounded up to a unit's 1024 is shown in
    the next unit (found by a review)."""
    cases = {1023: "1023 B", 1023.5: "1.0 KiB", 1048524: "1023.9 KiB", 1048575: "1.0 MiB",
             (1 << 30) - 1: "1.0 GiB", (1 << 40) - 1: "1.0 TiB", (1 << 20) * 1.5: "1.5 MiB"}
    assert {n: _human_bytes(n) for n in cases} == cases


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_gc_refuses_a_metric_no_step_records(
    manager_root: Path, capsys: pytest.CaptureFixture[str], dry_run: list[str]
) -> None:
    """`gc --keep-best 1 --best-metric los` (the steps record `loss`) was accepted: no step
    ranks as best, so retention deleted the best step (found by a review). It is a usage
    error naming the metrics the steps record, and nothing is deleted."""
    leftover = manager_root / "step-50" / "data" / "x.bin"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"x")
    argv = ["gc", str(manager_root), "--keep-last", "1", "--keep-best", "1"]
    code, out, err = _run(capsys, *argv, "--best-metric", "los", *dry_run)
    assert (code, out) == (2, "")
    assert "--best-metric 'los': no committed step" in err and "record 'loss'" in err
    assert sp.CheckpointManager(str(manager_root)).steps() == [10, 30, 40]
    assert leftover.exists()
    code, out, err = _run(capsys, *argv, "--best-metric", "loss", *dry_run)
    assert code == 0, err
    assert "kept step 10: best" in out
    assert sp.CheckpointManager(str(manager_root)).steps() == ([10, 30, 40] if dry_run
                                                               else [10, 40])
