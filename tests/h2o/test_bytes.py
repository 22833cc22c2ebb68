"""The byte budget of the h2o cache (caches/h2o/bytes.py, `max_kv_bytes`): the units it is written
in, the configuration it resolves, and the footprint it never passes, also while a prompt arrives in
chunks larger than the cache's eviction step."""

import mlx.core as mx
import pytest
from decoding import tokens
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.caches.h2o import H2OKVCache
from mlx_h2o.caches.h2o.bytes import full_token_bytes
from mlx_h2o.option_kinds import Bytes

CHUNKS = (64, 1, 1, 200, 1, 300, 3, 1, 1, 150, 1, 1)  # a prompt in prefill chunks, decode steps between


def held(caches):
    return [c for c in caches if isinstance(c, H2OKVCache)]


def allocated(cache) -> int:
    """Bytes of every buffer a cache's lanes hold (rows at their capacity, columns, the archive), the
    rotation's per-layer matrices aside: what the byte model bounds, reservations included."""
    seen, total = set(), 0

    def walk(obj):
        nonlocal total
        if isinstance(obj, mx.array):
            total += obj.nbytes
        elif isinstance(obj, (tuple, list)):
            for x in obj:
                walk(x)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x)
        elif hasattr(obj, "__dict__") and id(obj) not in seen and type(obj).__name__ != "KVRotation":
            seen.add(id(obj))
            walk({k: v for k, v in vars(obj).items() if k != "_view"})  # (a RowStore's views of its own buffers)

    for lane in cache.lanes or ():
        walk(lane.store)
        walk(lane.archive)
    return total


def feed(model, caches, x, chunks=CHUNKS):
    """Feed x (1, T) in `chunks`, yielding after every call."""
    pos = 0
    for n in chunks:
        mx.eval(model(x[:, pos : pos + n], cache=caches))
        pos += n
        yield pos


@pytest.mark.parametrize("text, value", [("64MB", 64 * 10**6), ("1.5GiB", 3 * 2**29), ("512KB", 512000), ("512 kib", 512 * 1024),
                                         ("1000", 1000), ("2.5MiB", 5 * 2**19)])
def test_byte_counts_parse_in_decimal_and_binary_units(text, value):
    assert Bytes().parse("max_kv_bytes", text) == value
    assert Bytes().check("max_kv_bytes", value) == value


@pytest.mark.parametrize("bad", ["64XB", "MB", "-5MB", "", "1e6"])
def test_bad_byte_counts_raise(bad):
    with pytest.raises(ValueError, match="max_kv_bytes must be a number of bytes"):
        Bytes().parse("max_kv_bytes", bad)
    with pytest.raises(ValueError, match="number of bytes >= 1"):
        Bytes().check("max_kv_bytes", 0)


# (model overrides, options): packed 4/8 rotated by the rule (head dim 64), unpacked where the group
# size does not divide the head dim (16), and options the user gives over the rule's.
CONFIGS = [
    (dict(head_dim=64), {}),
    (dict(), {}),
    (dict(head_dim=64), dict(evicted_bits="2", score="cumulative")),
    (dict(head_dim=64), dict(kv_bits="8", evict_every=5)),
    (dict(head_dim=64), dict(kv_bits="4", rotate=True, split="balanced", select="layer")),
    (dict(head_dim=64), dict(kv_recent_rows=8, split="recent")),
    (dict(head_dim=64), dict(kv_dtype="float16")),  # the rule's packed rows, float16 scales and biases
    (dict(head_dim=64), dict(kv_sink_rows=2, sink=3)),
    (dict(), dict(kv_dtype="bfloat16")),  # dense rows at half the bytes
    (dict(), dict(merge=0.5)),
]


@pytest.mark.parametrize("overrides, options", CONFIGS)
@pytest.mark.parametrize("budget", [120_000, "300KB", "0.5MiB"])
def test_footprint_never_exceeds_the_byte_budget(overrides, options, budget):
    model = tiny_model("llama", **overrides)
    caches = mlx_h2o.make_cache(model, "h2o", max_kv_bytes=budget, **options)
    limit = Bytes().check("max_kv_bytes", budget)
    x = mx.array(tokens(sum(CHUNKS))[None])
    for _ in feed(model, caches, x):
        layers = held(caches)
        assert sum(c.nbytes for c in layers) <= limit
        assert sum(allocated(c) for c in layers) <= limit
        assert all(c.length <= c.budget.max_kv_size for c in layers)
    c = layers[0]
    assert c.offset == sum(CHUNKS) and (c.evictions > 0 or c.budget.max_kv_size >= sum(CHUNKS))
    if "kv_bits" not in options:
        storage = c.config.storage
        assert storage.kv_bits == ("4/8" if overrides else None) and storage.rotate == bool(overrides)
        assert storage.kv_recent_rows == options.get("kv_recent_rows", 64 if overrides else None)
        assert storage.kv_sink_rows == options.get("kv_sink_rows", 4 if overrides else None)
        # keys less their mean, unless the user keeps an archive (its rows are not centred)
        assert storage.center_keys == (bool(overrides) and "evicted_bits" not in options)
        # packed: float16 rows (scales and biases) and a scale per 64 values, unless given
        assert storage.kv_dtype == options.get("kv_dtype", "float16" if overrides else None)
        assert storage.group_size == (64 if overrides else 32)
    assert c.config.budget.split == options.get("split", "balanced" if overrides else "heavy")  # the rule's unless given


def test_budget_resolves_the_largest_m_that_fits():
    model = tiny_model("llama", head_dim=64)
    small, large = (mlx_h2o.make_cache(model, "h2o", max_kv_bytes=b) for b in ("200KB", "400KB"))
    x = mx.array(tokens(8)[None])
    for caches in (small, large):
        mx.eval(model(x, cache=caches))
    m_small, m_large = small[0].budget.max_kv_size, large[0].budget.max_kv_size
    assert m_large > 1.9 * m_small
    # One more entry would not fit: the bound of M + 1 passes the budget.
    from mlx_h2o.caches.h2o.bytes import _config_at, layer_bound

    c = large[0]
    per_layer = 400_000 // 2
    H, dims = c.shape[1], c.head_dims
    unresolved = {**c.config.options(), "heavy": None, "recent": None, "evict_every": None}  # as the rule resolves them
    stored = 2  # the rule keeps the float32 model's rows as float16 before packing: 2-byte scales and biases
    assert c.config.storage.kv_dtype == "float16"
    assert layer_bound(c.config, H, dims, stored) <= per_layer < layer_bound(_config_at(unresolved, m_large + 1), H, dims, stored)
    # Held to the bytes of an fp32 window of T tokens, the packed cache keeps several times T (80 / 512 bytes an entry at d = 64
    # in the 4-bit tier, group 64).
    T = 400_000 / (2 * full_token_bytes(H, dims, 4))
    assert m_large > 4 * T


@pytest.mark.parametrize("options, dtype, group", [
    (dict(), "float16", 64),  # the rule's
    (dict(kv_dtype="float32"), "float32", 64),
    (dict(kv_group_size=32), "float16", 32),
    (dict(kv_bits="8"), None, 32),  # a user's storage is taken as given: the model's dtype, the default group
    (dict(kv_bits="8", kv_group_size=64, kv_dtype="float16"), "float16", 64),
])
def test_byte_rule_storage_yields_to_the_users_options(options, dtype, group):
    model = tiny_model("llama", head_dim=64)
    caches = mlx_h2o.make_cache(model, "h2o", max_kv_bytes="300KB", **options)
    mx.eval(model(mx.array(tokens(8)[None]), cache=caches))
    storage = caches[0].config.storage
    assert (storage.kv_dtype, storage.group_size) == (dtype, group)
    store = caches[0].lanes[0].store.inner  # (under the columns)
    # (the rule's: rotated, centred, sink rows, then the tiers; a user's one format as it is)
    keys = store.inner.inner.rest.high.k.arrays if "kv_bits" not in options else store.k.arrays
    assert keys[1].dtype == getattr(mx, dtype or "float32") and keys[1].shape[-1] == 64 // group  # scales as stored


def test_byte_rule_groups_by_32_where_64_does_not_divide():
    from mlx_h2o.caches.h2o.bytes import rule_for

    assert rule_for(256, (64, 64)).kv_group_size == 64
    assert rule_for(256, (96, 96)).kv_group_size == 32 and rule_for(256, (96, 96)).kv_bits == "4/8"
    assert rule_for(256, (16, 16)).kv_bits is None  # no group divides: the model's dtype
    assert rule_for(256, (64, 64), group_size=128).kv_bits is None


def test_budget_too_small_names_the_smallest_that_works():
    model = tiny_model("llama", head_dim=64)
    caches = mlx_h2o.make_cache(model, "h2o", max_kv_bytes="1KB")
    with pytest.raises(ValueError, match=r"max_kv_bytes=1.00KB \(1000 bytes\) is too small .* smallest that works here is ([\d.]+)KB \((\d+) bytes") as e:
        mx.eval(model(mx.array(tokens(4)[None]), cache=caches))
    smallest = int(str(e.value).split("KB (")[-1].split(" bytes")[0])
    caches = mlx_h2o.make_cache(model, "h2o", max_kv_bytes=smallest)
    x = mx.array(tokens(40)[None])
    for _ in feed(model, caches, x, (16, 1, 1, 20, 1, 1)):
        assert sum(c.nbytes for c in held(caches)) <= smallest


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(max_kv_size=64, max_kv_bytes="1MB"), "give max_kv_size .* or max_kv_bytes .*, not both"),
        (dict(), "needs max_kv_size or max_kv_bytes"),
        (dict(max_kv_bytes="1MB", pin="0:8"), "pinned spans live outside the budget"),
        (dict(max_kv_bytes="1MB", layer_budget="pyramid"), "layer_budget='uniform'"),
        (dict(max_kv_bytes="1MB", split="explicit", heavy=4, recent=4), "not split='explicit'"),
        (dict(max_kv_bytes="64XB"), "max_kv_bytes must be a number of bytes"),
    ],
)
def test_bad_byte_budgets_raise(options, match):
    with pytest.raises(ValueError, match=match):
        mlx_h2o.make_cache(tiny_model("llama"), "h2o", **options)


def test_byte_budget_reaches_every_front_end():
    """Declared once: make_cache (above), `--kv-option` / specs of the CLI, mlx-lm's plugin."""
    from mlx_h2o.mlx_lm_plugin import PluginPolicy

    policy = mlx_h2o.POLICIES["h2o"]
    assert policy.parse_options({"max_kv_bytes": "64MB"}) == {"max_kv_bytes": 64 * 10**6}  # --kv-option, specs
    (option,) = [o for o in PluginPolicy(policy).options if o.name == "max_kv_bytes"]
    assert option.type("512KB") == 512000 and option.default is None


def test_cli_specs_take_a_byte_budget():
    from mlx_h2o.evaluation.runner import parse_specs

    (spec,) = parse_specs(["h2o:max_kv_bytes=1.5GiB,score=cumulative"])
    assert spec.options["max_kv_bytes"] == 3 * 2**29


def test_byte_budget_cache_saves_and_loads(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_model("llama", head_dim=64)
    caches = mlx_h2o.make_cache(model, "h2o", max_kv_bytes="300KB")
    x = mx.array(tokens(300)[None])
    list(feed(model, caches, x, (200, 1, 99)))
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    nxt = mx.array(tokens(301)[None, -1:])
    assert mx.allclose(model(nxt, cache=caches), model(nxt, cache=loaded), atol=1e-4)
    assert loaded[0].config == caches[0].config and loaded[0].config.budget.max_kv_bytes == 300000
