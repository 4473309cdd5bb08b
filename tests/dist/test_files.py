"""``push_files`` and ``meshplan files push`` (runtime/_files.py, _files_worker.py, _cli_files.py)
with real worker processes, 1, 2 and 3 of them.

Files are copied, never computed, so every check demands byte equality (sha256 of each file)
and equal permission bits. The tree has nested and empty folders, an empty file, an executable,
a 200 MB file (zeros with random bytes in every chunk, so no two chunks are alike), and two
symlinks inside the tree. Faults are injected through ``push_files``'s ``_faults``: one byte
flipped in flight (after signing) and a rank killed by SIGKILL mid-push.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from meshplan._errors import RuntimeFailure
from meshplan.runtime import FILES_PLUGIN, LocalLauncher, push_files

BIG = 200 * 10**6
MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def _make_tree(root: Path) -> Path:
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "a" / "hello.txt").write_text("hello\n")
    (root / "a" / "b" / "empty.txt").write_bytes(b"")
    run = root / "a" / "b" / "c" / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    (root / "secret.txt").write_text("x")
    (root / "secret.txt").chmod(0o600)
    with open(root / "big.bin", "wb") as f:          # sparse, with random bytes in every MiB
        f.truncate(BIG)
        for off in range(0, BIG, MIB):
            f.seek(off)
            f.write(os.urandom(4096))
    os.symlink("a/hello.txt", root / "link_file")
    os.symlink("b", root / "a" / "link_dir")
    return root


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MIB):
            h.update(block)
    return h.hexdigest()


_SOURCE_DIGESTS: dict[tuple, str] = {}


def _source_digest(path: Path) -> str:
    """``_digest`` of a source file, computed once while the file stays as it was (same inode,
    size, modification and change times): the module's tree is compared with every rank's copy
    after every push, and its 200 MB file takes ~0.4 s to hash."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _SOURCE_DIGESTS:
        _SOURCE_DIGESTS[key] = _digest(path)
    return _SOURCE_DIGESTS[key]


def _assert_same_tree(src: Path, dst: Path) -> None:
    """Same entries, same bytes, same permission bits, symlinks as the same symlinks."""
    def entries(root: Path) -> dict[str, os.stat_result]:
        return {str(p.relative_to(root)): p.lstat() for p in root.rglob("*")
                if not p.name.startswith(".")}

    want, got = entries(src), entries(dst)
    assert sorted(want) == sorted(got)
    for rel, st in want.items():
        path = dst / rel
        if os.path.islink(src / rel):
            assert path.is_symlink() and os.readlink(path) == os.readlink(src / rel), rel
        elif (src / rel).is_dir():
            assert path.is_dir() and not path.is_symlink(), rel
        else:
            assert path.is_file() and not path.is_symlink(), rel
            assert _digest(path) == _source_digest(src / rel), rel
        assert (got[rel].st_mode & 0o7777) == (st.st_mode & 0o7777), rel


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_tree(tmp_path_factory.mktemp("src"))


def _launch(n: int):
    return LocalLauncher().launch(n, env={"MESHPLAN_WORKER_PLUGINS": FILES_PLUGIN})


@pytest.fixture(scope="module")
def workers2():
    with _launch(2) as workers:
        yield workers


@pytest.fixture(scope="module")
def workers3():
    with _launch(3) as workers:
        yield workers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_push_tree_then_skip_unchanged(tree: Path, tmp_path: Path, n: int,
                                       request: pytest.FixtureRequest) -> None:
    """Every rank gets a byte-equal copy; a second push sends nothing; a changed file only it."""
    template = str(tmp_path / "dst{rank}")
    workers = request.getfixturevalue(f"workers{n}")
    first = push_files(tree, template, workers=workers)
    for rank in range(n):
        _assert_same_tree(tree, tmp_path / f"dst{rank}")
    total = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
    assert (first.files, first.bytes, first.bytes_sent, first.files_skipped) == (5, total, total, 0)
    assert first.dirs == 4 and first.symlinks == 2
    assert [r.files_written for r in first.ranks] == [5] * n
    assert not list((tmp_path / "dst0").rglob(".*.mppart*"))

    again = push_files(tree, template, workers=workers)
    assert (again.bytes_sent, again.files_sent, again.files_skipped) == (0, 0, 5)
    assert [r.files_skipped for r in again.ranks] == [5] * n

    (tmp_path / f"dst{n - 1}" / "a" / "hello.txt").write_text("changed on one rank\n")
    (tmp_path / "dst0" / "secret.txt").chmod(0o644)        # mode only: fixed, not re-sent
    fix = push_files(tree, template, workers=workers)
    assert (fix.files_sent, fix.bytes_sent) == (1, len("hello\n"))
    assert [r.files_written for r in fix.ranks] == [0] * (n - 1) + [1]
    for rank in range(n):
        _assert_same_tree(tree, tmp_path / f"dst{rank}")


@pytest.mark.timeout(60)
def test_a_silent_connection_first_does_not_hold_the_push(tmp_path: Path, workers3) -> None:
    """Issue 19, point 5: a peer without the push's key connects to every writer's listener
    before its chain neighbour and says nothing; each writer vets connections on their own
    with a short hello deadline, so the push completes (an io timeout of 200 s would outlast
    this test's 60 s if the silent connection held the listener)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(3 * 64 * 1024))
    push_files(src, str(tmp_path / "dst{rank}"), workers=workers3, chunk_bytes=64 * 1024,
               io_timeout_s=200, _faults={"squat": True})
    for rank in range(3):
        _assert_same_tree(src, tmp_path / f"dst{rank}")


@pytest.mark.timeout(60)
def test_corrupt_chunks_are_detected_and_resent(tmp_path: Path, workers3) -> None:
    """One byte flipped after signing, once on the controller -> rank 0 link and once on the
    rank 0 -> rank 1 link: each receiver rejects the chunk and its sender resends it. Also a
    template without {rank}: the ranks share one destination, so only rank 0 writes it (with a
    progress callback); and SRC given as one file lands as DEST/NAME."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(10 * 64 * 1024))
    workers = workers3
    result = push_files(src, str(tmp_path / "dst{rank}"), workers=workers,
                        chunk_bytes=64 * 1024, _faults={"corrupt": [[-1, 3], [0, 5]]})
    rejected = [r.chunks_rejected for r in result.ranks]
    assert rejected == [1, 1, 0] and [r.chunks_resent for r in result.ranks] == [1, 0, 0]
    for rank in range(3):
        _assert_same_tree(src, tmp_path / f"dst{rank}")

    seen: list[tuple[int, int]] = []
    shared = push_files(src, str(tmp_path / "one" / "{host}"), workers=workers,
                        progress=lambda done, total: seen.append((done, total)))
    assert seen[0] == (0, 10 * 64 * 1024) and seen[-1] == (10 * 64 * 1024,) * 2
    assert [r.role for r in shared.ranks] == ["writer", "shared", "shared"]
    assert [r.shares_with for r in shared.ranks] == [None, 0, 0]
    assert shared.ranks[0].files_written == 1
    _assert_same_tree(src, tmp_path / "one" / workers.hostnames[0])

    single = push_files(src / "data.bin", str(tmp_path / "single{rank}"), workers=workers)
    assert (single.files, single.files_sent) == (1, 1)
    for rank in range(3):
        assert _digest(tmp_path / f"single{rank}" / "data.bin") == _digest(src / "data.bin")


@pytest.mark.timeout(90)
def test_killed_rank_fails_clearly_and_rerun_resumes(tree: Path, tmp_path: Path, workers2) -> None:
    """kill -9 rank 0 (the middle of controller -> 0 -> 1) during the 200 MB file: the push fails
    naming rank 0, and a second push on fresh workers resumes from the verified chunks: it sends
    strictly fewer bytes than the fresh push did, and the copies end byte-equal. (The rerun uses
    the module's other two workers: the killed rank's group was stopped, as launches promise.)"""
    template = str(tmp_path / "dst{rank}")
    side = tmp_path / "dst0" / ".big.bin.mppart.json"
    errors: list[BaseException] = []
    with _launch(2) as workers:
        def push() -> None:
            try:
                push_files(tree, template, workers=workers, chunk_bytes=MIB,
                           _faults={"delay": [0, 0.01]})
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        thread = threading.Thread(target=push)
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if len(json.loads(side.read_text())["chunks"]) >= 30:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        else:
            pytest.fail("rank 0 never checkpointed 30 chunks of big.bin")
        os.kill(workers.pids[0], signal.SIGKILL)
        thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeFailure)
    message = str(errors[0])
    assert "rank 0 was killed by SIGKILL" in message and "run the same push again" in message

    total = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
    resumed = push_files(tree, template, workers=workers2, chunk_bytes=MIB)
    assert 0 < resumed.bytes_sent < total        # a fresh push sends `total` (checked above)
    assert resumed.ranks[0].bytes_resumed >= 30 * MIB
    for rank in range(2):
        _assert_same_tree(tree, tmp_path / f"dst{rank}")
    assert not list(tmp_path.rglob(".*.mppart*"))


@pytest.mark.timeout(60)
def test_bwlimit_holds_every_link_to_its_rate(tmp_path: Path, workers3) -> None:
    """``bwlimit`` paces the controller and every forwarding rank. A lower bound on the time
    is safe under any load (a pacer only ever waits longer): 6 MiB at 8 MiB/s cannot arrive in
    less than (6 MiB - a burst and a slice, which may go at once) / rate, per link and hence
    for the chain. No upper bound: a loaded machine may be slower. The data arrives intact."""
    from meshplan.runtime._files import Pacer

    src = tmp_path / "src"
    src.mkdir()
    (src / "data").write_bytes(os.urandom(6 * MIB))
    rate = 8 * MIB
    t = time.perf_counter()
    result = push_files(src, str(tmp_path / "dst{rank}"), workers=workers3, bwlimit=rate,
                        chunk_bytes=MIB)
    assert time.perf_counter() - t >= (6 * MIB - Pacer.BURST - Pacer.SLICE) / rate
    assert result.bytes_sent == 6 * MIB
    for rank in range(3):
        _assert_same_tree(src, tmp_path / f"dst{rank}")


def test_pacer_spreads_a_payload_over_time() -> None:
    import socket

    from meshplan.runtime._files import Pacer

    a, b = socket.socketpair()
    got = bytearray()
    reader = threading.Thread(target=lambda: [got.extend(x) for x in iter(
        lambda: b.recv(1 << 20), b"")])
    reader.start()
    pacer = Pacer(8 * MIB)
    payload = os.urandom(4 * MIB)
    t = time.perf_counter()
    pacer.send(a, payload)
    elapsed = time.perf_counter() - t
    a.close()
    reader.join()
    b.close()
    assert bytes(got) == payload
    assert elapsed >= (4 * MIB - Pacer.BURST - Pacer.SLICE) / (8 * MIB)
    time.sleep(0.2)                  # idle: the pacer saves up at most one burst of credit
    c, d = socket.socketpair()
    drain = threading.Thread(target=lambda: [None for _ in iter(lambda: d.recv(1 << 20), b"")])
    drain.start()
    t = time.perf_counter()
    pacer.send(c, payload)
    assert time.perf_counter() - t >= (4 * MIB - Pacer.BURST - Pacer.SLICE) / (8 * MIB)
    c.close()
    drain.join()
    d.close()
    with pytest.raises(RuntimeFailure, match="bwlimit=0"):
        Pacer(0)


def test_bad_inputs_fail_before_launch(tree: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure, match="does not exist"):
        push_files(tmp_path / "missing", str(tmp_path / "d{rank}"), ranks=2)
    with pytest.raises(RuntimeFailure, match=r"uses \{foo\}"):
        push_files(tree, str(tmp_path / "d{foo}"), ranks=2)
    with pytest.raises(RuntimeFailure, match="not a valid template"):
        push_files(tree, str(tmp_path / "d{rank"), ranks=2)
    (tmp_path / "src").mkdir()
    (tmp_path / "target.txt").write_text("not in the tree")
    os.symlink("../target.txt", tmp_path / "src" / "escape")
    with pytest.raises(RuntimeFailure, match="points outside SRC"):
        push_files(tmp_path / "src", str(tmp_path / "d{rank}"), ranks=2)
    with pytest.raises(RuntimeFailure, match="bwlimit=-1"):
        push_files(tree, str(tmp_path / "d{rank}"), ranks=2, bwlimit=-1)


@pytest.mark.timeout(60)
def test_unwritable_destination_names_the_rank(tmp_path: Path) -> None:
    """Tests run as root here, so 'unwritable' is a destination below a regular file."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("f")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    with pytest.raises(RuntimeFailure, match=r"rank 0 failed in 'files.prepare': "
                                             r"NotADirectoryError") as info:
        push_files(src, str(blocker / "{rank}"), ranks=1)
    assert len(str(info.value).splitlines()) == 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("meshplan")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "meshplan"]
    return subprocess.run([*cmd, "files", "push", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.timeout(120)
def test_cli_push_json(tmp_path: Path) -> None:
    """``meshplan files push ... --json`` end to end, as a separate process."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "x.py").write_text("print('x')\n")
    proc = _cli(str(src), "--dest", str(tmp_path / "dst{rank}"), "--ranks", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["files"], out["files_sent"], out["bytes_sent"]) == (1, 1, 11)
    assert [r["role"] for r in out["ranks"]] == ["writer"] * 2
    for rank in range(2):
        _assert_same_tree(src, tmp_path / f"dst{rank}")



@pytest.mark.parametrize("args, text", [
    (["--launcher", "k8s"], "unknown --launcher 'k8s'"),
    (["--dest", "/tmp/{foo}"], "uses {foo}"),
    (["--src", "/nonexistent/meshplan-src"], "does not exist"),
    (["--chunk-size", "lots"], "--chunk-size 'lots'"),
    (["--bwlimit", "fast"], "--bwlimit 'fast'"),
    (["--bwlimit", "0"], "--bwlimit '0'"),
])
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                 args: list[str], text: str) -> None:
    """In-process ``meshplan`` (the same ``main`` the script runs): exit 1, one stderr line."""
    from meshplan.cli import main

    opts = {"--src": str(tmp_path), "--dest": str(tmp_path / "d{rank}"), "--ranks": "2"}
    opts.update(zip(args[::2], args[1::2]))
    argv = ["files", "push", opts.pop("--src")] + [x for kv in opts.items() for x in kv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err and "Traceback" not in err, err
