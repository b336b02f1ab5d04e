"""The ``local`` KV pool: shared memory between real processes, and a response moved
between two real engines through it."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from pool_workload import greedy

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.kv_connector.base import KVBlockIO, KVPoolError
from seer_engine.kv_connector.factory import kv_pool_for
from seer_engine.kv_connector.local import LocalStore
from seer_engine.sampling_params import SamplingParams

BB = 64  # bytes per block in the store-level tests: 16 float32
REPO = Path(__file__).resolve().parents[1]
SPAWN = multiprocessing.get_context("spawn")


def rows(*values: float) -> torch.Tensor:
    return torch.stack([torch.full((BB // 4,), float(v)) for v in values])


def read(store: LocalStore, keys: list[str]) -> list[float]:
    out = torch.empty(len(keys), BB // 4)
    store.get_into(keys, out)
    assert bool((out == out[:, :1]).all()), "a block came back mixed"
    return out[:, 0].tolist()


def segments_of(spec) -> list[str]:
    names = [spec.data_name, spec.index_name]
    return [n for n in names if os.path.exists(f"/dev/shm/{n}")] + [
        p for p in [spec.lock_path] if os.path.exists(p)
    ]


@pytest.fixture(scope="module", autouse=True)
def no_leaked_segments():
    """Every segment and lock file these tests create is gone when they are done."""
    yield
    gc.collect()
    mine = f"seer_kv_{os.getpid()}_"  # pool names carry their creator's pid
    left = [f for f in os.listdir("/dev/shm") if f.startswith(mine)]
    left += [f for f in os.listdir(tempfile.gettempdir()) if f.startswith(mine)]
    assert not left, f"shared memory left behind: {left}"


@pytest.fixture(scope="module")
def worker():
    """One spawned process that outlives several tests (a spawn start costs seconds)."""
    with ProcessPoolExecutor(1, mp_context=SPAWN) as ex:
        yield ex


@pytest.fixture
def store():
    s = LocalStore.create(capacity_bytes=8 * BB, block_bytes=BB)
    yield s
    s.close()


# -- one process -------------------------------------------------------------------


def test_round_trip(store):
    store.put(["a/0", "a/1", "b/0"], rows(1, 2, 3))
    assert read(store, ["b/0", "a/0", "a/1"]) == [3.0, 1.0, 2.0]
    assert store.used_slots == 3 and store.num_slots == 8
    # Any dtype and shape whose rows are one block; a non-contiguous destination works too.
    half = torch.arange(2 * BB // 2, dtype=torch.bfloat16).view(2, 4, 8)
    store.put(["h/0", "h/1"], half)
    out = torch.empty(4, 8, 2, dtype=torch.bfloat16).permute(2, 0, 1)
    store.get_into(["h/0", "h/1"], out)
    assert torch.equal(out, half)


def test_overwrite_reuses_the_slot(store):
    store.put(["a/0", "a/1"], rows(1, 2))
    store.put(["a/0"], rows(5))
    assert read(store, ["a/0", "a/1"]) == [5.0, 2.0]
    assert store.used_slots == 2
    store.put(["c/0", "c/0"], rows(7, 8))  # the last value of a repeated key wins
    assert read(store, ["c/0"]) == [8.0] and store.used_slots == 3


def test_count_leading_stops_at_the_first_gap(store):
    store.put(["a/0", "a/2", "a/3"], rows(0, 2, 3))
    assert store.count_leading(["a/0", "a/1", "a/2", "a/3"]) == 1
    assert store.count_leading(["a/2", "a/3"]) == 2
    assert store.count_leading(["a/1", "a/2"]) == 0
    assert store.count_leading([]) == 0


def test_remove_prefix_removes_exactly_that_parent(store):
    store.put(["s/r1/0", "s/r1/1", "s/r10/0", "s/r1/x/0", "t/r1/0"], rows(1, 2, 3, 4, 5))
    assert store.remove_prefix("s/r1/") == 2
    assert store.count_leading(["s/r1/0"]) == 0 and store.count_leading(["s/r1/1"]) == 0
    assert read(store, ["s/r10/0", "s/r1/x/0", "t/r1/0"]) == [3.0, 4.0, 5.0]
    assert store.used_slots == 3
    assert store.remove_prefix("s/r1/") == 0
    with pytest.raises(ValueError, match="end in '/'"):
        store.remove_prefix("s/r1")


def test_full_pool_fails_whole_and_frees_on_remove():
    s = LocalStore.create(capacity_bytes=4 * BB + 10, block_bytes=BB)
    try:
        assert s.num_slots == 4
        s.put(["a/0", "a/1", "a/2"], rows(0, 1, 2))
        with pytest.raises(KVPoolError, match=r"local KV pool full.*capacity 256 bytes"):
            s.put(["a/0", "b/0", "b/1"], rows(9, 9, 9))
        assert s.count_leading(["b/0"]) == 0 and s.count_leading(["b/1"]) == 0
        assert read(s, ["a/0"]) == [0.0]  # the existing key in the failed put is untouched
        assert s.used_slots == 3
        s.put(["a/1", "b/0"], rows(11, 10))  # overwrites need no free slot: one new key fits
        assert s.used_slots == 4
        assert s.remove_prefix("a/") == 3
        s.put(["b/1", "b/2", "b/3"], rows(1, 2, 3))
        assert read(s, ["b/0", "b/1", "b/2", "b/3"]) == [10.0, 1.0, 2.0, 3.0]
    finally:
        s.close()


def test_wrong_sizes_and_keys_are_rejected(store):
    with pytest.raises(ValueError, match="blocks of 64 bytes.*are 32 bytes"):
        store.put(["a/0"], torch.zeros(1, 8))
    with pytest.raises(ValueError, match="2 rows for 1 keys"):
        store.put(["a/0"], rows(1, 2))
    with pytest.raises(ValueError, match="<parent>/<index>"):
        store.put(["nokey"], rows(1))
    store.put(["a/0"], rows(1))
    with pytest.raises(ValueError, match="are 128 bytes"):
        store.get_into(["a/0"], torch.empty(1, 32))
    assert store.used_slots == 1
    with pytest.raises(ValueError, match="cannot hold one block"):
        LocalStore.create(capacity_bytes=10, block_bytes=BB)


def test_missing_key_names_the_key(store):
    store.put(["a/0"], rows(1))
    with pytest.raises(KVPoolError, match="'a/9' is not in the local KV pool"):
        store.get_into(["a/0", "a/9"], torch.empty(2, BB // 4))


def test_close_detaches_openers_and_destroys_for_the_owner():
    owner = LocalStore.create(capacity_bytes=4 * BB, block_bytes=BB)
    spec = pickle.loads(pickle.dumps(owner.spec))
    other = LocalStore.open(spec)
    other.put(["a/0"], rows(4))
    other.close()
    other.close()
    with pytest.raises(KVPoolError, match="closed"):
        other.count_leading(["a/0"])
    assert len(segments_of(spec)) == 3  # an opener's close leaves the pool
    assert read(owner, ["a/0"]) == [4.0]
    owner.close()
    assert segments_of(spec) == []
    with pytest.raises(KVPoolError, match="is not in this process.s /dev/shm"):
        LocalStore.open(spec)


def test_owner_dropped_without_close_still_unlinks():
    s = LocalStore.create(capacity_bytes=4 * BB, block_bytes=BB)
    spec = s.spec
    s.put(["a/0"], rows(1))
    del s
    gc.collect()
    assert segments_of(spec) == []


# -- several processes -------------------------------------------------------------


def _child_reads_and_writes(spec) -> list[float]:
    s = LocalStore.open(spec)
    seen = read(s, ["p/0", "p/1"])
    s.put(["c/0", "c/1"], rows(10, 11))
    s.remove_prefix("gone/")
    s.close()
    return seen


def _child_overwrites(spec, seconds: float) -> int:
    s = LocalStore.open(spec)
    n = 0
    blocks = torch.empty(1, spec.block_bytes // 4)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        n += 1
        blocks.fill_(float(n))
        s.put(["h/0"], blocks)
    s.close()
    return n


def test_spawned_child_shares_the_pool(store):
    store.put(["p/0", "p/1", "gone/0"], rows(1, 2, 3))
    with ProcessPoolExecutor(1, mp_context=SPAWN) as ex:
        assert ex.submit(_child_reads_and_writes, store.spec).result(timeout=120) == [1.0, 2.0]
    # The child has exited: its resource tracker must not have unlinked the pool.
    assert len(segments_of(store.spec)) == 3
    assert read(store, ["c/0", "c/1", "p/0"]) == [10.0, 11.0, 1.0]
    assert store.count_leading(["gone/0"]) == 0
    assert store.used_slots == 4


_DIES_MID_PUT = (
    "import os, pickle, sys, torch\n"
    "from seer_engine.kv_connector.local import LocalStore\n"
    "s = LocalStore.open(pickle.loads(bytes.fromhex(sys.argv[1])))\n"
    "class Dies:\n"
    "    def __setitem__(self, slots, value):\n"
    "        os._exit(3)  # killed after claiming its slots, before copying\n"
    "s._m.slab = Dies()\n"
    "s.put(sys.argv[2:], torch.zeros(len(sys.argv) - 2, 16))\n"
)


def _die_mid_put(store: LocalStore, keys: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", _DIES_MID_PUT, pickle.dumps(store.spec).hex(), *keys],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 3, done.stderr


def test_slots_of_a_put_that_died_are_taken_back():
    """An instance killed while saving a chunk's KV leaves claimed slots: removing the
    response (it finished elsewhere), any later removal or a put into a full pool takes them back."""
    store = LocalStore.create(capacity_bytes=3 * BB, block_bytes=BB)
    try:
        _die_mid_put(store, ["r/0", "r/1"])
        assert store.used_slots == 2 and store.count_leading(["r/0"]) == 0
        assert store.remove_prefix("r/") == 0 and store.used_slots == 0
        _die_mid_put(store, ["q/0", "q/1"])
        store.put(["a/0", "a/1", "a/2"], rows(1, 2, 3))  # needs every slot: the dead put's go
        assert read(store, ["a/0", "a/1", "a/2"]) == [1.0, 2.0, 3.0] and store.used_slots == 3
        store.remove_prefix("a/")
        _die_mid_put(store, ["s/0", "s/1"])
        assert store.remove_prefix("other/") == 0 and store.used_slots == 0  # any removal sweeps them
    finally:
        store.close()


def test_a_dead_writer_not_yet_reaped_counts_as_gone():
    """A killed instance is a zombie until its parent reaps it; its claimed slots must go
    back on removal all the same (it will never publish them)."""
    store = LocalStore.create(capacity_bytes=3 * BB, block_bytes=BB)
    spec = pickle.dumps(store.spec).hex()
    argv = [sys.executable, "-c", _DIES_MID_PUT, spec, "z/0", "z/1"]
    child = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE)
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        if not stat.exists():
            pytest.skip("no /proc on this system")
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":  # exited, not reaped
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # blocks until it exits; reaps nothing
        assert store.used_slots == 2
        assert store.remove_prefix("z/") == 0 and store.used_slots == 0
    finally:
        assert child.wait() == 3, child.stderr.read().decode()
        store.close()


_OWNS_A_POOL = (
    "import pickle, sys\n"
    "from multiprocessing import resource_tracker\n"
    "from seer_engine.kv_connector.local import LocalStore\n"
    "s = LocalStore.create(capacity_bytes=4 * 64, block_bytes=64)\n"
    "print(pickle.dumps(s.spec).hex(), resource_tracker._resource_tracker._pid, flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_killed_owner_leaves_nothing_behind():
    """SIGKILL runs no finalizer: the owner's resource tracker unlinks its segments, and
    the pool's lock must go with them (no lock file left in the temp directory)."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNS_A_POOL], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        spec_hex, tracker = owner.stdout.readline().split()
        spec = pickle.loads(bytes.fromhex(spec_hex))
        assert len(segments_of(spec)) == 3
        tracker_exit = os.pidfd_open(int(tracker))
        owner.send_signal(signal.SIGKILL)
        assert owner.wait(60) == -signal.SIGKILL
        assert select.select([tracker_exit], [], [], 60)[0], "its resource tracker exits once it is gone"
        os.close(tracker_exit)
    finally:
        owner.kill()
        owner.wait()
    assert segments_of(spec) == []


_FILLS_ITS_SHM = (
    "import os, torch\n"
    "from seer_engine.kv_connector.base import KVPoolFull\n"
    "from seer_engine.kv_connector.local import LocalStore\n"
    "bb = 64 << 10\n"
    "s = LocalStore.create(32 * bb, bb)\n"  # 2 MiB: fits the 4 MiB /dev/shm when made
    "tiny = LocalStore.create(16384 * 64, 64)\n"  # a 512 KiB index: its pages too
    "fd = os.open('/dev/shm/filler', os.O_WRONLY | os.O_CREAT)\n"  # then another program takes the rest
    "try:\n"
    "    while True:\n"
    "        os.write(fd, b'x' * 4096)\n"
    "except OSError:\n"
    "    os.close(fd)\n"
    "for store, n in ((s, 32), (tiny, 1)):\n"
    "    keys, blocks = [f'a/{i}' for i in range(n)], torch.ones(n, store.block_bytes, dtype=torch.uint8)\n"
    "    try:\n"
    "        store.put(keys, blocks)\n"
    "    except KVPoolFull:\n"
    "        assert store.used_slots == 0\n"
    "        print('full', flush=True)\n"
    "os.unlink('/dev/shm/filler')\n"
    "for store, n in ((s, 32), (tiny, 1)):\n"
    "    store.put([f'a/{i}' for i in range(n)], torch.ones(n, store.block_bytes, dtype=torch.uint8))\n"
    "    assert store.count_leading([f'a/{i}' for i in range(n)]) == n\n"
    "print('served', flush=True)\n"
    "s.close()\n"
    "tiny.close()\n"
)


def test_a_put_into_a_dev_shm_filled_since_the_pool_was_made_fails_as_full():
    """Segments are sparse: room in /dev/shm checked when the pool is made can be taken
    by others later, and a put's copy into pages that cannot be had killed the instance
    with SIGBUS (then the next instance, and the rollout). Such a put is refused as
    full. Runs on a 4 MiB /dev/shm of its own (a private mount namespace)."""
    inner = f'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c "$0"'
    argv = ["unshare", "--mount", "--map-root-user", "sh", "-c", inner, _FILLS_ITS_SHM]
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                            "mount -t tmpfs -o size=4m tmpfs /dev/shm"], capture_output=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split() == ["full", "full", "served"]


def test_unrelated_process_exit_keeps_the_pool(store):
    """A process with its own resource tracker that attaches and exits without close."""
    store.put(["p/0"], rows(1))
    script = (
        "import pickle, sys, torch\n"
        "from seer_engine.kv_connector.local import LocalStore\n"
        "s = LocalStore.open(pickle.loads(bytes.fromhex(sys.argv[1])))\n"
        "s.put(['u/0'], torch.full((1, 16), 7.0))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, pickle.dumps(store.spec).hex()],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert len(segments_of(store.spec)) == 3
    assert read(store, ["p/0", "u/0"]) == [1.0, 7.0]


def test_reads_never_see_a_half_written_block(worker):
    """A child overwrites a 1 MiB block as fast as it can while the parent reads it."""
    s = LocalStore.create(capacity_bytes=4 << 20, block_bytes=1 << 20)
    try:
        s.put(["h/0"], torch.zeros(1, (1 << 20) // 4))
        out = torch.empty(1, (1 << 20) // 4)
        reads = 0
        fut = worker.submit(_child_overwrites, s.spec, 0.5)
        while not fut.done():
            time.sleep(0.0003)  # flock is not fair: a reader in a tight loop starves the writer
            try:
                s.get_into(["h/0"], out)
            except KVPoolError as e:  # mid-overwrite the key reads as absent
                assert "not in the local KV pool" in str(e) or "rewritten" in str(e)
                continue
            assert bool((out == out[0, 0]).all()), "read a half-written block"
            reads += 1
        writes = fut.result()
        s.get_into(["h/0"], out)
        assert bool((out == float(writes)).all())
        assert reads > 0 and writes > 0 and s.used_slots == 1
    finally:
        s.close()


# -- two engines -------------------------------------------------------------------


def _engine_saves(model: str, spec, prompt: list[int]) -> tuple[list[int], int]:
    """Engine A in its own process: run the first chunk and save its KV to the pool."""
    a = LLMEngine(EngineConfig(model=model, num_kv_blocks=64))
    conn = spec.open()
    a.add_request("r1", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    first: list[int] = []
    while a.has_unfinished_requests():
        for out in a.step():
            first = list(out.outputs[0].token_ids)
    saved = conn.save("s", a, prompt + first)
    conn.close()
    return first, saved


def test_response_moves_between_engine_processes(tiny_model, worker):
    path = str(tiny_model())
    cfg = EngineConfig(model=path, num_kv_blocks=64)
    b = LLMEngine(cfg)
    assert isinstance(b, KVBlockIO)
    bs = b.kv_block_size
    pool = kv_pool_for("local", cfg, capacity_gib=0.01)
    conn = pool.connector
    try:
        prompt = [(7 * i + 3) % 500 + 5 for i in range(30)]
        fut = worker.submit(_engine_saves, path, pool.spec, prompt)
        reference = greedy(LLMEngine(cfg), "ref", prompt, 40, [])  # while A works
        first, saved = fut.result(timeout=240)
        context = prompt + first
        assert first == reference[:20]
        assert saved == len(context) // bs * bs == 48
        assert conn.lookup("s", context) == 48

        r = conn.load("s", b, context)
        assert (r.tokens, r.loaded_tokens, r.error) == (48, 48, None)
        before = b.scheduler.stats.scheduled_tokens
        assert greedy(b, "r2", prompt, 40, first) == reference
        computed = b.scheduler.stats.scheduled_tokens - before
        assert computed == len(context) - r.tokens + (40 - 20 - 1)  # 2 context tokens, then decode

        assert conn.store.used_slots == 3
        conn.free("s")
        assert conn.store.used_slots == 0 and conn.stats.failures == 0
    finally:
        pool.close()
    assert segments_of(conn.store.spec) == []
