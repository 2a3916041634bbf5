"""The persistent compile cache: a repeat reads it, a different program never does."""

import dataclasses
import gzip
import os

import jax
import jax.numpy as jnp
import pytest

import remat_kit
from remat_kit import analyze, targets
from remat_kit.memory import compile_cache as C
from remat_kit.memory import hlo, runner
from remat_kit.memory.xla_compile import CompileResult


def _mlp(x, w):  # x [batch, d_in], w [d_in, d_out]
    return jnp.tanh(x @ w).sum()


def _scanned(policy):
    """A 4-layer scanned MLP loss under ``policy``: the policy changes the program."""

    def layer(h, w):
        return jnp.tanh(h @ w), None

    def loss(ws, x):
        body = jax.checkpoint(layer, policy=policy)
        h, _ = jax.lax.scan(body, x, ws)
        return (h**2).sum()

    return jax.grad(loss)


def _args(d_in=16):
    return jax.ShapeDtypeStruct((8, d_in), jnp.float32), jax.ShapeDtypeStruct(
        (d_in, 4), jnp.float32
    )


@pytest.fixture
def compiles(monkeypatch, fresh_compile_cache):
    """Counts the compiles XLA runs (not those read from the cache), into an empty cache."""
    count = []
    real = runner.compile_with_dump

    def counted(*a, **k):
        count.append(a[2])
        return real(*a, **k)

    monkeypatch.setattr(runner, "compile_with_dump", counted)
    return count


def _same(a, b):
    """Reports equal but for the cache flag and the compile's seconds."""
    return dataclasses.replace(a, compile_cached=False, compile_s=0) == dataclasses.replace(
        b, compile_cached=False, compile_s=0
    )


def test_repeat_reads_the_cache_and_gives_the_same_report(compiles):
    first, again = (analyze(_mlp, *_args(), target="cpu") for _ in range(2))
    assert len(compiles) == 1 and not first.compile_cached and again.compile_cached
    assert again == dataclasses.replace(first, compile_cached=True)  # compile_s: the entry's
    assert again.peak_bytes > 0 and again.flops == first.flops


def test_one_shape_apart_is_another_program(compiles, monkeypatch):
    small = analyze(_mlp, *_args(16), target="cpu")
    wide = analyze(_mlp, *_args(17), target="cpu")
    assert len(compiles) == 2 and not wide.compile_cached
    assert wide.argument_bytes != small.argument_bytes
    monkeypatch.setenv(C.ENV_OFF, "1")  # the same program compiled afresh, cache off
    assert _same(analyze(_mlp, *_args(17), target="cpu"), wide)


def test_one_policy_apart_is_another_program(compiles):
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    ws = jax.ShapeDtypeStruct((4, 32, 32), jnp.float32)
    pol = jax.checkpoint_policies
    saved = analyze(_scanned(pol.everything_saveable), ws, x, target="cpu", policy="save")
    remat = analyze(_scanned(pol.nothing_saveable), ws, x, target="cpu", policy="remat")
    # Another line: source positions are not in the key (they reach no reader).
    again = analyze(_scanned(pol.nothing_saveable), ws, x, target="cpu", policy="remat")
    assert len(compiles) == 2 and not remat.compile_cached
    assert remat.flops > saved.flops  # the recomputed matmuls: not the first program's report
    assert again.compile_cached and _same(again, remat)


def test_off_writes_and_reads_nothing(compiles, monkeypatch):
    monkeypatch.setenv(C.ENV_OFF, "1")
    analyze(_mlp, *_args(), target="cpu")
    analyze(_mlp, *_args(), target="cpu")
    assert len(compiles) == 2 and C.CompileCache.from_env() is None
    assert not any(C.default_folder().rglob("*.json.gz"))


def _fake(size: int) -> CompileResult:
    text = os.urandom(size).hex()  # incompressible
    return CompileResult(
        compiled=C.CachedExecutable({"temp_size_in_bytes": 1}, text),
        compile_s=1.0, dump=hlo.DumpFiles(text, None, None, None), thread=0, start=0.0,
        end=0.0, logged=[],
    )  # fmt: skip


def test_bounded_least_recently_used_go_first(tmp_path):
    cache = C.CompileCache(tmp_path, max_bytes=10**9)
    for key in "abc":
        cache.store(key * 64, _fake(4000))
    entry = cache.size_bytes() // 3
    for i, key in enumerate("abc"):  # mtimes in storing order, 10 s apart
        os.utime(cache._path(key * 64), (1000 + 10 * i, 1000 + 10 * i))
    assert cache.load("a" * 64) is not None  # a read makes "a" the most recently used
    cache.max_bytes = 2 * entry + entry // 2
    assert cache.evict() == 1
    assert cache.load("b" * 64) is None and cache.load("a" * 64) is not None
    assert cache.size_bytes() <= cache.max_bytes
    # the part file of a write killed an hour ago goes; one being written now stays
    old, fresh = cache.entries / ".x.json.gz.1-2-ab.part", cache.entries / ".y.json.gz.3-4-cd.part"
    old.write_bytes(b"torn")
    fresh.write_bytes(b"writing")
    os.utime(old, (1000, 1000))
    cache.evict()
    assert not old.exists() and fresh.exists()


def test_torn_or_foreign_entries_are_misses(tmp_path):
    cache = C.CompileCache(tmp_path)
    cache.store("a" * 64, _fake(100))
    path = cache._path("a" * 64)
    path.write_bytes(path.read_bytes()[:50])  # torn write
    assert cache.load("a" * 64) is None and not path.exists()
    cache.store("b" * 64, _fake(100))
    os.replace(cache._path("b" * 64), cache._path("c" * 64))  # an entry under another key
    assert cache.load("c" * 64) is None
    blob = gzip.compress(b"not json")
    cache._path("d" * 64).write_bytes(blob)
    assert cache.load("d" * 64) is None


def test_request_key_text_does_not_follow_the_hash_seed():
    """A frozenset's repr follows PYTHONHASHSEED; the request key's text sorts it."""
    from remat_kit.policies import custom_spec

    a = custom_spec({"query_proj": "save", "key_proj": "save", "out_proj": "offload"})
    assert C.canonical(a) == C.canonical(dataclasses.replace(a, save=frozenset(sorted(a.save))))
    assert C.canonical({"b": frozenset("zyx")}) == "[[\"'b'\", [\"'x'\", \"'y'\", \"'z'\"]]]"


def test_key_covers_target_options_and_flags(monkeypatch):
    text = "module @jit_f {}"
    base = C.CompileCache.key(text, targets.get_target("cpu"), {"a": 1})
    assert base == C.CompileCache.key(text, targets.get_target("cpu"), {"a": 1, "xla_dump_to": "x"})
    located = 'op loc(#loc4)\n#loc3 = loc("/a/b.py":29:15 to :40)\n#loc4 = loc("jit(f)/dot"(#loc3))'
    moved = located.replace("29:15", "31:2")
    key = C.CompileCache.key(located, targets.get_target("cpu"), {})
    assert key == C.CompileCache.key(moved, targets.get_target("cpu"), {})  # a moved line
    # traced from elsewhere (another tool): other alias numbers, a call-site chain
    elsewhere = (
        'op loc(#loc9)\n#loc7 = loc("/c.py":3:1)\n#loc8 = loc(callsite(#loc7 at "/d.py":5:2))'
        '\n#loc9 = loc("jit(f)/dot"(#loc8))'
    )
    assert key == C.CompileCache.key(elsewhere, targets.get_target("cpu"), {})
    renamed = located.replace("jit(f)/dot", "jit(f)/mul")  # op names reach the readers
    assert key != C.CompileCache.key(renamed, targets.get_target("cpu"), {})
    inline = r'op loc("jit(f)/dot"("/a.py":1:2))' + "\n" + r'op2 loc("x\"(y)"(#loc1))'
    inline += "\n#loc1 = loc(unknown)"
    assert C.canonical_locations(inline) == 'op loc["jit(f)/dot"]\n' + r'op2 loc["x\"(y)"]' + "\n"
    # a name ending in "loc" is not a location: its arguments stay in the key
    call = "func.call @my_alloc(%arg0) : (tensor<{}xf32>) -> () loc(#loc1)\n#loc1 = loc(unknown)"
    assert C.canonical_locations(call.format(4)).startswith("func.call @my_alloc(%arg0) : (")
    assert C.CompileCache.key(call.format(4), targets.get_target("cpu"), {}) != (
        C.CompileCache.key(call.format(8), targets.get_target("cpu"), {})
    )
    others = [
        C.CompileCache.key(text + " ", targets.get_target("cpu"), {"a": 1}),
        C.CompileCache.key(text, targets.get_target("h100-sxm"), {"a": 1}),
        C.CompileCache.key(text, targets.get_target("h200"), {"a": 1}),
        C.CompileCache.key(text, targets.get_target("cpu"), {"a": 2}),
    ]
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    others.append(C.CompileCache.key(text, targets.get_target("cpu"), {"a": 1}))
    assert len({base, *others}) == 1 + len(others)


def test_bundled_model_repeat_traces_nothing(compiles, monkeypatch):
    """A repeated request on a bundled model reads its reports: nothing traced or compiled; a
    request one policy apart is traced and compiled."""
    from remat_kit import get_config, preset
    from remat_kit.memory import api

    config = get_config("tiny-gpt", num_layers=1)

    def run(policy):
        return api.analyze_policies(preset(config, 1, 8, "sgd"), [policy], target="cpu")

    first = run("save-nothing")
    # and the no-remat step, unseen, that the memory-not-freed judgement needs
    assert [c.split("'")[1] for c in compiles] == ["save-nothing", "no-remat"]
    setup = api.trace.trace_program
    monkeypatch.setattr(api.trace, "trace_program", lambda *a: pytest.fail("traced on a repeat"))
    again = run("save-nothing")
    assert len(compiles) == 2 and again == [dataclasses.replace(first[0], compile_cached=True)]
    monkeypatch.setattr(api.trace, "trace_program", setup)
    (other,) = run("save-dots")  # its no-remat step read from the compile cache
    assert len(compiles) == 3 and not other.compile_cached and other.policy == "save-dots"


@pytest.fixture
def jax_persistent_cache(tmp_path):
    """JAX's own persistent compilation cache on, in ``tmp_path``, writing every entry (as a
    MaxText user's environment has it: ``jax_compilation_cache_dir``); off again afterwards."""
    from jax._src import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {n: getattr(jax.config, n) for n in names}
    for name, value in zip(names, (str(tmp_path), 0.0, 0), strict=True):
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used
    yield tmp_path
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_jax_persistent_cache_never_answers_an_analysis_compile(jax_persistent_cache):
    """A hit in JAX's cache would return an executable without XLA's dumps (jax leaves
    ``xla_dump_to`` out of its key): every analysis compile must run XLA, and write nothing
    there."""
    from remat_kit.memory.xla_compile import capture_compiler_log, compile_with_dump

    lowered = jax.jit(_scanned(jax.checkpoint_policies.nothing_saveable)).lower(
        jax.ShapeDtypeStruct((4, 16, 16), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32)
    )
    with capture_compiler_log():
        first = compile_with_dump(lowered, "cpu", "first")
        second = compile_with_dump(lowered, "cpu", "second")
    for result in (first, second):
        assert result.dump.hlo is not None and result.dump.buffer_assignment is not None
    assert hlo.count_flops(second.dump.module).flops == hlo.count_flops(first.dump.module).flops
    assert not any(jax_persistent_cache.iterdir())
    # The cache is on: a plain compile of the same program is written to it.
    lowered.compile()
    assert any(jax_persistent_cache.iterdir())


needs_cuda = pytest.mark.skipif(
    targets.cuda_plugin_module() is None, reason="JAX's CUDA plugin is not installed"
)


@needs_cuda
def test_gpu_kernels_kept_between_runs_change_no_figure(tmp_path, monkeypatch):
    """XLA's kernel cache of a deviceless GPU target outlives its engine (one file per target
    and compiler versions) and seeds the next engine's; the reports are the same cold or warm;
    a local target keeps none."""
    monkeypatch.setenv(C.ENV_KERNELS, str(tmp_path / "kernels"))
    monkeypatch.setenv(C.ENV_OFF, "1")  # every compile runs XLA
    h100 = targets.get_target("h100-sxm")
    kept = C.kernel_cache_file(h100, None)
    assert kept is not None and kept.parent == tmp_path / "kernels"
    assert C.kernel_cache_file(targets.get_target("local"), tmp_path) is None
    assert C.kernel_cache_file(targets.get_target("a100-80gb"), None) != kept
    sharding = targets.abstract_sharding(h100)
    args = (jax.ShapeDtypeStruct((4, 16, 16), jnp.float32), _args()[0])
    fn = jax.jit(_scanned(jax.checkpoint_policies.nothing_saveable))

    @dataclasses.dataclass
    class Item:
        what: str = "scanned MLP"
        target: targets.Target = h100
        program_key: str | None = None

        def lower(self):
            return fn.lower(*targets.abstractify(args, sharding))

    results = []
    for _ in range(2):
        with runner.CompileEngine(cache=None) as engine:
            [(_, result)] = engine.compile_all([Item()])
            started = os.path.getsize(engine._caches.seed)
        assert kept.stat().st_size >= started > 0
        results.append(result)
    cold, warm = (r.dump for r in results)
    assert warm.buffer_assignment == cold.buffer_assignment and warm.hlo == cold.hlo


def test_recommend_says_what_it_read_from_the_cache(compiles):
    """A repeated recommend compiles nothing and says how many candidates the cache gave (it
    printed 'compiles: 0 (+0 reused)', as if it had not looked at them)."""
    from remat_kit import Program
    from remat_kit.recommend import recommend

    ws = jnp.ones((4, 16, 16)) * 0.1
    program = Program.from_loss(_scanned_loss, ws, jnp.ones((8, 16)), optimizer="sgd", name="mlp4")
    policies = ["no-remat", "save-nothing"]
    first = recommend(program, target="cpu", budget="1GiB", policies=policies)
    again = recommend(program, target="cpu", budget="1GiB", policies=policies)
    assert first.from_compile_cache == 0 and len(compiles) == 2
    assert again.from_compile_cache == 2 and len(compiles) == 2
    assert [c.peak_bytes for c in again.candidates] == [c.peak_bytes for c in first.candidates]


def _scanned_loss(policy):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    def loss(ws, x):
        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        h, _ = jax.lax.scan(body, x, ws)
        return (h**2).sum()

    return loss


@pytest.mark.parametrize("target", ["local", "h100-sxm"])
def test_items_are_made_while_the_ones_before_them_compile(target, monkeypatch):
    """compile_all takes its items one at a time and compiles each as soon as it may: a
    generator that waits for the first compile's ``then`` before making the second item ends
    (it waited forever when every item was made, or on a GPU every item lowered, before any
    compile after the first started). On a GPU target the compiles after the first wait for it
    (it fills the kernel cache), then start while later items are still being made."""
    import threading

    monkeypatch.setenv(C.ENV_OFF, "1")
    tgt = targets.get_target(target)
    sharding = targets.abstract_sharding(tgt)
    policies = [
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.everything_saveable,
        jax.checkpoint_policies.dots_saveable,
    ]

    @dataclasses.dataclass
    class Item:
        policy: object
        what: str = "scanned MLP"
        target: targets.Target = tgt
        program_key: str | None = None

        def lower(self):
            args = (jax.ShapeDtypeStruct((4, 16, 16), jnp.float32), _args()[0])
            return jax.jit(_scanned(self.policy)).lower(*targets.abstractify(args, sharding))

    done = {i: threading.Event() for i in range(len(policies))}
    made, read = [], []

    def items():
        for i, policy in enumerate(policies):
            if i >= 2:  # the compile of the item before the last has run meanwhile
                assert done[i - 1].wait(60), f"item {i - 1} not compiled while items were made"
            item = Item(policy)
            made.append(item)
            yield item

    def then(item, result):
        read.append((threading.get_native_id(), result.dump.hlo is not None))
        done[made.index(item)].set()

    with runner.CompileEngine(cache=None) as engine:
        out = engine.compile_all(items(), fast=True, total=len(policies), then=then)
    assert len({key for key, _ in out}) == len(policies)
    assert all(isinstance(r, CompileResult) for _, r in out)
    assert len(read) == len(policies) and all(dumped for _, dumped in read)
    assert threading.get_native_id() not in {thread for thread, _ in read}  # in the workers


def test_the_cpu_and_the_local_cpu_backend_share_their_compiles():
    """``analyze`` (target local) then ``recommend --target cpu`` compiled every policy twice
    on a CPU machine (180 s for 16 compiles: outside trial, session 16): both compile on the one
    CPU backend, to the same program."""
    from remat_kit import targets as T
    from remat_kit.memory.compile_cache import target_fingerprint

    local = T.get_target("local")
    if local.platform != "cpu":
        pytest.skip("the local backend is an accelerator here")
    assert T.compile_identity(local) == T.compile_identity(T.get_target("cpu")) == "cpu"
    assert target_fingerprint(local) == target_fingerprint(T.get_target("cpu"))
    assert T.compile_identity(T.get_target("h100-sxm")) == "h100-sxm"
    assert target_fingerprint(T.get_target("h100-sxm")) != target_fingerprint(local)


def test_a_presets_reports_under_jax_remat3_are_not_the_classic_ones(fresh_compile_cache):
    """The stored reports of a preset request are keyed by the remat implementation too: under
    jax_remat3 the same request is traced again (its figures and remat_impl its own), never read
    back from the classic run (a shared cache of the suite's once did)."""
    from remat_kit import policies as RP

    config = remat_kit.get_config("tiny-gpt", num_layers=1, scan_layers=True)
    runs = {}
    for impl in ("classic", "remat3"):
        with RP.using(impl):
            (runs[impl],) = remat_kit.analyze_policies(
                remat_kit.preset(config, 1, 16), ["save-nothing"], target="cpu"
            )
    assert runs["classic"].remat_impl == "classic" and runs["remat3"].remat_impl == "remat3"
