"""The ``mooncake`` KV pool against real ``mooncake_master`` processes on 127.0.0.1: the
store's semantics, another process's client, a response moved between two real engines,
and a master that dies (every call fails fast, nothing hangs)."""

from __future__ import annotations

import importlib.util
import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from pool_workload import greedy

if importlib.util.find_spec("mooncake") is None:
    pytest.skip("the Mooncake wheel is not installed (pip install '.[mooncake]')", allow_module_level=True)

from seer_engine.engine.config import EngineConfig  # noqa: E402
from seer_engine.engine.llm_engine import LLMEngine  # noqa: E402
from seer_engine.kv_connector.base import KVPoolError  # noqa: E402
from seer_engine.kv_connector.factory import kv_pool_for, make_kv_pool  # noqa: E402
from seer_engine.kv_connector.mooncake import MooncakeMaster, MooncakeSpec, MooncakeStore  # noqa: E402
from seer_engine.kv_connector.mooncake import store as mooncake_store  # noqa: E402
from seer_engine.kv_connector.mooncake.common import answers, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPAWN = multiprocessing.get_context("spawn")
_names = itertools.count()


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster(segment_bytes=64 << 20) as m:
        yield m


@pytest.fixture(scope="module")
def store(master):
    s = MooncakeStore(master.address, master.metadata_server)
    yield s
    s.close()


@pytest.fixture
def ns() -> str:
    """A key prefix no other test uses (the tests share one pool)."""
    return f"t{next(_names)}/"


def filled(n: int, width: int = 16, start: float = 0.0) -> torch.Tensor:
    return torch.stack([torch.full((width,), float(start + i)) for i in range(n)])


def keys_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# -- the master ----------------------------------------------------------------------


def test_master_that_cannot_start_says_why(tmp_path):
    with pytest.raises(KVPoolError, match="mooncake_master not found"):
        MooncakeMaster(binary=str(tmp_path / "no-such-binary"))
    with pytest.raises(KVPoolError, match="exited with code 1"):
        MooncakeMaster(binary="/bin/false")


def test_master_lifecycle_and_a_taken_port(monkeypatch):
    """Another program listening on the chosen RPC port answers probes too; that master
    exits (silently) and a new one starts on other ports."""
    import seer_engine.kv_connector.mooncake.master as mc

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        first = iter([port])
        monkeypatch.setattr(mc, "free_port", lambda host: next(first, None) or free_port(host))
        with MooncakeMaster() as m:
            assert m.rpc_port != port and m.running and m.holder_pid is None
            assert m.address == f"127.0.0.1:{m.rpc_port}" and answers("127.0.0.1", m.rpc_port)
            assert m.metadata_server == f"http://127.0.0.1:{m.http_port}/metadata"
            log_dir = m.log_path.parent
            assert m.log_path.stat().st_size > 0
    assert not m.running and not answers("127.0.0.1", m.rpc_port)
    assert not log_dir.exists()
    m.stop()  # idempotent


_MASTER_SCRIPT = """
import os, signal, subprocess, sys, threading
from seer_engine.kv_connector.mooncake import MooncakeMaster
if sys.argv[1] == "thread":  # as the server does: its engine thread starts the pool
    started = []
    thread = threading.Thread(target=lambda: started.append(MooncakeMaster(segment_bytes=16 << 20)))
    thread.start()
    thread.join()
    m = started[0]
    try:  # the thread that asked for the master has ended: the master must not end with it
        m._master.wait(1.0)
        raise RuntimeError("the master ended with the thread that started it")
    except subprocess.TimeoutExpired:
        pass
else:
    m = MooncakeMaster(segment_bytes=16 << 20)
print(m.pid, m.holder_pid, m.log_path.parent, flush=True)
if sys.argv[1] != "crash":
    os.kill(os.getpid(), signal.SIGKILL)
raise RuntimeError("crash without stopping the master")
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie nobody reaps yet
    except FileNotFoundError:
        return True


def test_master_dies_with_its_owner():
    """A crash runs the exit hooks; a SIGKILL leaves the parent-death signal to stop both,
    also when a thread other than the main one started them (``thread``: the server starts
    its pool on the engine thread)."""
    runs = {
        how: subprocess.Popen(
            [sys.executable, "-c", _MASTER_SCRIPT, how],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for how in ("crash", "kill", "thread")
    }
    for how, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == (1 if how == "crash" else -signal.SIGKILL), err.decode()[-2000:]
        words = out.split()
        assert len(words) == 3, err.decode()[-2000:]
        pids, log_dir = [int(p) for p in words[:2]], Path(words[2].decode())
        if how != "crash":  # nothing ran in the owner: its log folder stays behind
            shutil.rmtree(log_dir)
        assert not log_dir.exists()
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), f"{how}: mooncake processes {pids} outlived their owner"


# -- the store -----------------------------------------------------------------------


def test_round_trip_with_several_shapes(store, ns):
    kv = torch.randn(3, 2, 2, 4, 2, 8)  # [blocks, layers, k/v, block_size, heads, head_dim]
    store.put(keys_of(ns + "kv/", 3), kv)
    out = torch.empty_like(kv)
    store.get_into(keys_of(ns + "kv/", 3)[::-1], out)
    assert torch.equal(out, kv.flip(0))

    half = torch.arange(2 * 4 * 8, dtype=torch.bfloat16).view(2, 4, 8)
    store.put(keys_of(ns + "h/", 2), half)
    transposed = torch.empty(4, 8, 2, dtype=torch.bfloat16).permute(2, 0, 1)  # not contiguous
    store.get_into(keys_of(ns + "h/", 2), transposed)
    assert torch.equal(transposed, half)

    raw = torch.randint(0, 255, (2, 1 << 20), dtype=torch.uint8)  # 1 MiB blocks
    store.put(keys_of(ns + "u/", 2), raw)
    back = torch.empty_like(raw)
    store.get_into(keys_of(ns + "u/", 2), back)
    assert torch.equal(back, raw)

    store.put([ns + "d/0", ns + "d/0"], filled(2, start=1))  # a key given twice: the last wins
    one = torch.empty(1, 16)
    store.get_into([ns + "d/0"], one)
    assert one[0, 0].item() == 2.0


def test_overwrite_replaces_the_value(store, ns):
    keys = keys_of(ns, 2)
    store.put(keys, filled(2, start=1))
    out = torch.empty(2, 16)
    store.get_into(keys, out)  # the read takes a lease: the overwrite must still win
    store.put(keys, filled(2, start=7))
    store.get_into(keys, out)
    assert out[:, 0].tolist() == [7.0, 8.0]
    store.put(keys[:1], torch.full((1, 32), 5.0))  # another size
    wide = torch.empty(1, 32)
    store.get_into(keys[:1], wide)
    assert bool((wide == 5.0).all())


def test_count_leading_stops_at_the_first_gap(store, ns):
    store.put([ns + "0", ns + "1", ns + "3"], filled(3))
    assert store.count_leading(keys_of(ns, 5)) == 2
    assert store.count_leading(keys_of(ns, 2)) == 2
    assert store.count_leading([ns + "9", ns + "0"]) == 0
    assert store.count_leading([]) == 0


def test_remove_prefix_removes_what_starts_with_it(store, ns):
    odd = ns + "a+b(c)[d].e*f?g^h$i|j{k}\\l/"  # regex syntax in a prefix is literal
    store.put([odd + "0", odd + "1", ns + "a+b(c)[d]Xe*f?g^h$i|j{k}\\l/0", "x" + odd + "0"], filled(4))
    store.put(keys_of(ns + "r/", 3) + [ns + "r/sub/0", ns + "rx/0"], filled(5))
    assert store.remove_prefix(odd) == 2
    assert store.count_leading([ns + "a+b(c)[d]Xe*f?g^h$i|j{k}\\l/0", "x" + odd + "0"]) == 2
    out = torch.empty(3, 16)
    store.get_into(keys_of(ns + "r/", 3), out)  # leased by the read: removal is forced
    assert store.remove_prefix(ns + "r/") == 4
    assert store.count_leading([ns + "r/0"]) == 0 and store.count_leading([ns + "r/sub/0"]) == 0
    assert store.count_leading([ns + "rx/0"]) == 1
    assert store.remove_prefix(ns + "r/") == 0
    with pytest.raises(ValueError, match="empty prefix"):
        store.remove_prefix("")


def test_batches_larger_than_the_split(store, ns, master, monkeypatch):
    n = 2500  # one Mooncake batch of this many keys fails (per-peer transport queue)
    blocks = torch.arange(n, dtype=torch.float32).repeat_interleave(16).view(n, 16)
    keys = keys_of(ns + "big/", n)
    store.put(keys, blocks)
    assert store.count_leading(keys) == n
    out = torch.empty_like(blocks)
    store.get_into(keys, out)
    assert torch.equal(out, blocks)
    assert store.remove_prefix(ns + "big/") == n

    monkeypatch.setattr(store, "max_batch", 16)  # chunk edges: 50 = 3 * 16 + 2
    store.put(keys_of(ns + "m/", 50), blocks[:50])
    store.put([ns + "m/17"], blocks[:1])
    assert store.count_leading(keys_of(ns + "m/", 50)) == 50
    store.get_into(keys_of(ns + "m/", 50), out[:50])
    assert out[:50, 0].tolist() == [0.0 if i == 17 else float(i) for i in range(50)]

    small = MooncakeStore(master.address, master.metadata_server, local_buffer_size=256)
    try:  # 4 blocks of 64 bytes per staging batch; a larger block grows the buffer
        small.put(keys_of(ns + "s/", 10), blocks[:10])
        small.get_into(keys_of(ns + "s/", 10), out[:10])
        assert out[:10, 0].tolist() == [float(i) for i in range(10)]
        large = torch.randn(3, 1000)
        small.put(keys_of(ns + "l/", 3), large)
        back = torch.empty_like(large)
        small.get_into(keys_of(ns + "l/", 3), back)
        assert torch.equal(back, large)
    finally:
        small.close()


def test_missing_keys_and_mismatched_sizes_raise(store, ns):
    store.put([ns + "0"], filled(1))
    with pytest.raises(KVPoolError, match=f"{ns}1.*OBJECT_NOT_FOUND"):
        store.get_into([ns + "0", ns + "1"], torch.empty(2, 16))
    with pytest.raises(KVPoolError, match="is 64 bytes; the block needs 128"):
        store.get_into([ns + "0"], torch.empty(1, 32))
    with pytest.raises(KVPoolError, match="larger than the destination"):
        store.get_into([ns + "0"], torch.empty(1, 8))
    with pytest.raises(ValueError, match="1 rows for 2 keys"):
        store.put([ns + "0", ns + "1"], filled(1))


def test_no_master_fails_fast_and_says_where(master):
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    start = time.monotonic()
    with pytest.raises(KVPoolError, match=f"no Mooncake master answers at {address}"):
        MooncakeStore(address, "http://127.0.0.1:1/metadata")
    with pytest.raises(KVPoolError, match="metadata server http://127.0.0.1:1/metadata does not answer"):
        MooncakeStore(master.address, "http://127.0.0.1:1/metadata")
    assert time.monotonic() - start < 3
    with pytest.raises(ValueError, match="rdma.*needs device"):
        MooncakeStore(master.address, protocol="rdma")


class _Spy:
    """A client stand-in that records which of its methods are called."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, []

    def __getattr__(self, name: str):
        self.calls.append(name)
        return getattr(self.client, name)


def test_a_stopped_master_times_out_once_then_calls_fail_at_once(monkeypatch):
    """A stopped (or hung) master still accepts TCP connects, so the probe passes: the
    call that finds it waits out the RPC timeout, and the calls after it fail without
    reaching the client instead of each waiting as long (a rollout would stall)."""
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "300")
    monkeypatch.setattr(mooncake_store, "QUIET_S", (3600.0, 3600.0))  # outlasts any stall of the host
    with MooncakeMaster(segment_bytes=64 << 20) as m:
        s = MooncakeStore(m.address, m.metadata_server)
        s.put(["q/0"], filled(1))
        os.kill(m.pid, signal.SIGSTOP)
        try:
            with pytest.raises(KVPoolError, match="RPC_TIMEOUT"):
                s.count_leading(["q/0"])
            spy = s._h.client = _Spy(s._h.client)
            for call in (
                lambda: s.count_leading(["q/0"]),
                lambda: s.get_into(["q/0"], torch.empty(1, 16)),
                lambda: s.put(["q/1"], filled(1)),
                lambda: s.remove_prefix("q/"),
            ):
                with pytest.raises(KVPoolError, match="timed out"):
                    call()
            assert spy.calls == []
        finally:
            os.kill(m.pid, signal.SIGCONT)
        s._h.quiet.until = 0.0  # the quiet time is over
        assert s.count_leading(["q/0"]) == 1 and not s._h.quiet.timed_out_last
        s.close()


def _child_reads_and_writes(spec: MooncakeSpec, keys: list[str]) -> list[float]:
    s = MooncakeStore.open(spec)
    try:
        out = torch.empty(len(keys), 16)
        s.get_into(keys, out)
        s.put([k + "/child" for k in keys], filled(len(keys), start=10))
        return out[:, 0].tolist()
    finally:
        s.close()


def test_a_segment_larger_than_the_host_can_give_says_so(master):
    """``--kv-pool-gib`` past the host's memory: Mooncake's setup only answers a code;
    the error must say what was asked of the host, not leave the user guessing."""
    with pytest.raises(KVPoolError, match=r"not mount 1125899906842624 bytes .*--kv-pool-gib"):
        MooncakeStore(master.address, master.metadata_server, global_segment_size=1 << 50)


def test_another_process_opens_the_pool_from_the_spec(store, ns):
    """A spawned child reads what this process put and puts blocks that outlive it (the
    pool's memory is the master's segment holder, not the child's)."""
    spec = pickle.loads(pickle.dumps(store.spec))
    assert spec.global_segment_size == 0 and spec.master == store.master
    keys = keys_of(ns, 3)
    store.put(keys, filled(3, start=1))
    with ProcessPoolExecutor(1, mp_context=SPAWN) as ex:
        assert ex.submit(_child_reads_and_writes, spec, keys).result(timeout=120) == [1.0, 2.0, 3.0]
    out = torch.empty(3, 16)
    store.get_into([k + "/child" for k in keys], out)
    assert out[:, 0].tolist() == [10.0, 11.0, 12.0]


def test_connector_on_a_given_master_mounts_its_memory(master):
    pool = make_kv_pool(
        "mooncake",
        4,
        64,
        mooncake_master=master.address,
        mooncake_metadata=master.metadata_server,
        capacity_gib=(16 << 20) / 2**30,
        namespace="given",
    )
    conn = pool.connector
    assert pool.master is None and conn.namespace == "given" and conn.name == "mooncake"
    try:
        assert conn.store._spec.global_segment_size == 16 << 20
        assert conn.store.spec.global_segment_size == 0  # other processes mount nothing
        conn.store.put(conn._keys("x", list(range(9)), 1), filled(1))  # given/x/0-<digest>
        assert conn.lookup("x", list(range(9))) == 4
        conn.free("x")
        assert conn.lookup("x", list(range(9))) == 0
    finally:
        pool.close()
    conn.close()  # idempotent
    with pytest.raises(KVPoolError, match="closed"):
        conn.store.count_leading(["x/0"])


def test_freeing_a_response_leaves_one_whose_key_extends_it(master):
    """Group ids are callers' strings: response 1 of group ``a`` is ``a/1`` and response 0
    of group ``a/1`` is ``a/1/0``. Mooncake removes by prefix, so freeing the first must
    not take the second's blocks."""
    pool = make_kv_pool(
        "mooncake", 4, 64, mooncake_master=master.address, mooncake_metadata=master.metadata_server,
        capacity_gib=(16 << 20) / 2**30, namespace="nested",
    )  # fmt: skip
    conn = pool.connector
    try:
        context = list(range(9))
        for key in ("a/1", "a/1/0", "a%2F1"):
            conn.store.put(conn._keys(key, context, 1), filled(1))
            assert conn.lookup(key, context) == 4
        conn.free("a/1")
        assert conn.lookup("a/1", context) == 0
        assert conn.lookup("a/1/0", context) == 4 and conn.lookup("a%2F1", context) == 4
        assert conn.stats.failures == 0
    finally:
        pool.close()
    conn.close()


def test_servers_sharing_a_master_never_load_or_free_each_others_blocks(master):
    """Every server numbers its groups alike (``grp0/0``): two servers on one given master
    (other models, dtypes or weights) must not find, load or free each other's blocks."""
    address, metadata, gib = master.address, master.metadata_server, (16 << 20) / 2**30
    a, b = (make_kv_pool("mooncake", 4, 64, mooncake_master=address, mooncake_metadata=metadata,
                         capacity_gib=gib) for _ in range(2))  # fmt: skip
    try:
        context = list(range(9))
        a.connector.store.put(a.connector._keys("grp0/0", context, 1), filled(1))
        assert a.connector.lookup("grp0/0", context) == 4
        assert b.connector.lookup("grp0/0", context) == 0
        b.connector.free("grp0/0")
        assert a.connector.lookup("grp0/0", context) == 4
        assert a.connector.stats.failures == b.connector.stats.failures == 0
    finally:
        a.close()
        b.close()


def test_a_pool_on_a_given_master_leaves_none_of_its_blocks_when_it_closes(master, store):
    """A server on a shared master that stops with responses unfinished must take their
    blocks along: those in other processes' memory would outlive it, unreachable (its
    namespace dies with it), and crowd out the other servers' blocks."""
    big = 6 << 20  # its own 16 MiB segment holds two of these: the others go elsewhere
    pool = make_kv_pool(
        "mooncake", 4, big, mooncake_master=master.address, mooncake_metadata=master.metadata_server,
        capacity_gib=(16 << 20) / 2**30, namespace="leaving",
    )  # fmt: skip
    conn = pool.connector
    keys = [key for i in range(6) for key in conn._keys(f"grp0/{i}", list(range(9)), 1)]
    conn.store.put(keys, torch.zeros(6, big, dtype=torch.uint8))
    assert store.count_leading(keys) == 6
    pool.close()
    assert [store.count_leading([key]) for key in keys] == [0] * 6
    assert conn.stats.failures == 0


# -- two engines -----------------------------------------------------------------------


def test_response_moves_between_engines_then_the_master_dies(tiny_model):
    cfg = EngineConfig(model=str(tiny_model()), num_kv_blocks=64)
    a, b = LLMEngine(cfg), LLMEngine(cfg)
    bs = a.kv_block_size
    pool = kv_pool_for("mooncake", cfg, capacity_gib=(32 << 20) / 2**30)
    conn, owned = pool.connector, pool.master
    assert owned is not None and owned.running
    try:
        prompt = [(7 * i + 3) % 500 + 5 for i in range(30)]
        reference = greedy(LLMEngine(cfg), "ref", prompt, 40, [])
        first = greedy(a, "r1", prompt, 20, [])
        context = prompt + first
        assert first == reference[:20]
        assert conn.save("s", a, context) == len(context) // bs * bs == 48
        assert conn.lookup("s", context) == 48

        r = conn.load("s", b, context)
        assert (r.tokens, r.loaded_tokens, r.error) == (48, 48, None)
        before = b.scheduler.stats.scheduled_tokens
        assert greedy(b, "r2", prompt, 40, first) == reference
        computed = b.scheduler.stats.scheduled_tokens - before
        assert computed < bs + (40 - 20)
        assert computed == len(context) - r.tokens + (40 - 20 - 1)  # 2 context tokens, then decode
        conn.free("s")
        assert conn.lookup("s", context) == 0 and conn.stats.failures == 0

        conn.save("s", a, context)
        c = LLMEngine(cfg)
        os.kill(owned.pid, signal.SIGKILL)
        owned._master.wait(10)
        start = time.monotonic()
        r = conn.load("s", c, context)
        assert r.error is not None and "master" in r.error and r.loaded_tokens == 0
        assert conn.stats.failures == 1
        assert conn.save("s2", a, context) == 0
        assert conn.lookup("s", context) == 0
        conn.free("s")
        assert conn.stats.failures == 4
        for call in (
            lambda: conn.store.put(["s/9"], torch.zeros(1, 16)),
            lambda: conn.store.get_into(["s/0"], torch.zeros(1, 16)),
            lambda: conn.store.remove_prefix("s/"),
        ):
            with pytest.raises(KVPoolError, match="master"):
                call()
        conn.close()  # abandons the client: its own close would block for ~13 s
        assert time.monotonic() - start < 5
    finally:
        pool.close()
