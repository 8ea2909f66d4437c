"""Length predictors, the hashing embedder and the bucket metrics."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from slipstream_scheduler.lengths import (
    GlobalDistributionPredictor,
    HashingEmbedder,
    HistoryParams,
    InputLengthHistoryPredictor,
    InputLengthParams,
    SemanticHistoryParams,
    SemanticHistoryPredictor,
    VectorShapeError,
    bucket_of,
    bucket_probability,
    fixed_projection,
    median_bucket_hit,
)
from slipstream_scheduler.protocols import Embedder, LengthPredictor

pytestmark = pytest.mark.unit


def unit(*xs: float) -> np.ndarray:
    v = np.array(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


def test_hashing_embedder_is_deterministic_normalised_and_similarity_aware() -> None:
    e = HashingEmbedder(dim=256)
    assert isinstance(e, Embedder) and e.dim == 256
    v = e.embed(["Write a poem about the sea", "write a poem about the sea!", "Fix my car", ""])
    assert v.shape == (4, 256) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v[:3], axis=1), 1.0, atol=1e-6)
    assert float(v[0] @ v[1]) == pytest.approx(1.0, abs=1e-6)  # case and punctuation ignored
    assert float(v[0] @ v[2]) < 0.5
    assert not v[3].any()  # empty text: zero vector, never matches
    np.testing.assert_array_equal(
        HashingEmbedder(dim=256).embed(["Write a poem"]), e.embed(["Write a poem"])
    )


@pytest.mark.parametrize("bigram_weight", [1.0, 0.5])
def test_hashing_embedder_sums_a_signed_slot_per_word_and_bigram(bigram_weight: float) -> None:
    """The definition, feature by feature: the embedding is that sum, L2-normalised."""
    e = HashingEmbedder(dim=64, bigram_weight=bigram_weight)
    text = "Don't repeat the words; repeat the bigrams, then repeat the words"
    words = ["don't", "repeat", "the", "words", "repeat", "the", "bigrams", "then"]
    words += ["repeat", "the", "words"]
    want = np.zeros(64, dtype=np.float64)
    for w in words:
        i, sign = e._slot(w)
        want[i] += sign
    for a, b in itertools.pairwise(words):
        i, sign = e._slot(a + " " + b)
        want[i] += sign * bigram_weight
    want /= np.linalg.norm(want)
    np.testing.assert_allclose(e.embed_one(text), want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("bigram_weight", [1.0, 0.5])
def test_token_id_embedding_sums_a_signed_slot_per_id_and_id_pair(bigram_weight: float) -> None:
    """embed_ids by its definition, feature by feature in plain Python: splitmix64 of each id
    and of each adjacent pair ((a + 1) << 32 | b), slot (h >> 1) % dim, sign from h's low
    bit; the sum L2-normalised."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    e = HashingEmbedder(dim=64, bigram_weight=bigram_weight)
    ids = [101, 7592, 2088, 101, 7592, 0, 31999, 2088, 2**31 + 5]
    want = np.zeros(64, dtype=np.float64)
    features = [(i, 1.0) for i in ids] + [
        (((a + 1) << 32) | b, bigram_weight) for a, b in itertools.pairwise(ids)
    ]
    for key, weight in features:
        h = mix(key)
        want[(h >> 1) % 64] += weight if h & 1 else -weight
    want /= np.linalg.norm(want)
    np.testing.assert_allclose(e.embed_ids(ids), want, rtol=0, atol=1e-6)
    assert not e.embed_ids([]).any()


def test_token_id_embedding_keeps_shared_prefixes_near() -> None:
    e = HashingEmbedder()
    rng = np.random.default_rng(5)
    prompt = [int(i) for i in rng.integers(0, 32000, 400)]
    shared = prompt[:300] + [int(i) for i in rng.integers(0, 32000, 100)]
    other = [int(i) for i in rng.integers(0, 32000, 400)]
    v, w, u = e.embed_ids(prompt), e.embed_ids(shared), e.embed_ids(other)
    assert float(v @ v) == pytest.approx(1.0, abs=1e-6)
    assert float(v @ w) > 0.6 > 0.2 > abs(float(v @ u))
    np.testing.assert_array_equal(HashingEmbedder().embed_ids(prompt), v)


def test_semantic_threshold_selects_similar_prompts() -> None:
    p = SemanticHistoryPredictor(2, SemanticHistoryParams(min_matches=1, top_up="prior"))
    assert isinstance(p, LengthPredictor)
    p.observe(unit(1, 0), 10, 100)
    p.observe(unit(1, 0.1), 10, 120)
    p.observe(unit(0, 1), 10, 900)
    got = np.sort(p.predict(unit(1, 0.05), 10))
    np.testing.assert_array_equal(got, [100, 120])
    np.testing.assert_array_equal(p.predict(unit(0.1, 1), 10), [900])


def test_prior_tops_up_too_few_matches() -> None:
    params = SemanticHistoryParams(min_matches=4, top_up="prior")
    p = SemanticHistoryPredictor(2, params, prior_lengths=[7, 8, 9])
    # empty history: configured prior
    np.testing.assert_array_equal(np.sort(p.predict(unit(1, 0), 0)), [7, 8, 9])
    for length in (10, 20, 30, 40):
        p.observe(unit(0, 1), 0, length)
    p.observe(unit(1, 0), 0, 500)
    got = p.predict(unit(1, 0), 0)
    # one real match plus three quantiles of the history's global distribution
    assert got.shape == (4,) and 500.0 in got
    assert set(got.tolist()) - {500.0} <= {10.0, 20.0, 30.0, 40.0, 500.0}
    # nothing at all: the default
    bare = SemanticHistoryPredictor(2, SemanticHistoryParams(default_output_tokens=77))
    np.testing.assert_array_equal(bare.predict(unit(1, 0), 0), [77])


def test_nearest_top_up_uses_most_similar_records() -> None:
    p = SemanticHistoryPredictor(2, SemanticHistoryParams(min_matches=2, similarity_threshold=0.99))
    p.observe(unit(1, 0.3), 0, 100)
    p.observe(unit(1, 0.5), 0, 200)
    p.observe(unit(0, 1), 0, 900)
    got = np.sort(p.predict(unit(1, 0.4), 0))  # below 0.99 with everyone
    np.testing.assert_array_equal(got, [100, 200])


def test_fifo_window_forgets_oldest() -> None:
    p = GlobalDistributionPredictor(HistoryParams(window=3))
    for length in (1, 2, 3, 4, 5):
        p.observe(None, 0, length)
    assert len(p) == 3
    np.testing.assert_array_equal(np.sort(p.predict(None, 0)), [3, 4, 5])
    s = SemanticHistoryPredictor(2, SemanticHistoryParams(window=2, min_matches=0))
    s.observe(unit(1, 0), 0, 1)
    s.observe(unit(0, 1), 0, 2)
    s.observe(unit(0, 1), 0, 3)  # overwrites the (1, 0) record
    assert s.predict(unit(1, 0), 0).size == 0
    np.testing.assert_array_equal(np.sort(s.predict(unit(0, 1), 0)), [2, 3])


def test_input_length_neighbours() -> None:
    p = InputLengthHistoryPredictor(InputLengthParams(relative_tolerance=0.1, min_matches=1))
    p.observe(None, 100, 10)
    p.observe(None, 105, 20)
    p.observe(None, 300, 30)
    np.testing.assert_array_equal(np.sort(p.predict(None, 100)), [10, 20])
    np.testing.assert_array_equal(p.predict(None, 310), [30])


def test_global_sample_is_bounded_quantiles() -> None:
    p = GlobalDistributionPredictor(HistoryParams(max_global_samples=10))
    for length in range(1000):
        p.observe(None, 0, length)
    got = p.predict(None, 0)
    assert got.shape == (10,) and np.all(np.diff(got) > 0)
    assert got[0] < 100 and got[-1] > 900


def test_vector_shape_is_checked() -> None:
    p = SemanticHistoryPredictor(3)
    with pytest.raises(VectorShapeError) as err:
        p.observe(np.zeros(2, dtype=np.float32), 0, 1)
    assert err.value.expected_dim == 3 and err.value.got_shape == (2,)
    with pytest.raises(VectorShapeError):
        p.predict(None, 0)


def test_large_history_search_is_vectorised_and_correct() -> None:
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((10_000, 64)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    p = SemanticHistoryPredictor(64, SemanticHistoryParams(min_matches=0, similarity_threshold=0.3))
    for i, v in enumerate(vecs):
        p.observe(v, 0, i)
    q = vecs[123]
    want = np.flatnonzero(vecs @ q >= 0.3).astype(float)
    np.testing.assert_array_equal(np.sort(p.predict(q, 0)), want)


def _random_units(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    out: np.ndarray = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


@pytest.mark.parametrize("observed", [50, 3000, 7777])
def test_nearest_top_up_equals_a_full_sort(observed: int) -> None:
    """The block-bounded search returns the k most similar records, wrapped ring included."""
    rng = np.random.default_rng(observed)
    window, k = 3000, 8
    vecs = _random_units(rng, observed, 32)
    p = SemanticHistoryPredictor(
        32, SemanticHistoryParams(window=window, min_matches=k, similarity_threshold=0.99)
    )
    for i, v in enumerate(vecs):
        p.observe(v, 0, i)  # output = observation number, to find the record again
    kept = np.arange(max(0, observed - window), observed)
    for q in _random_units(rng, 20, 32):
        sims = p.similarities(q).copy()  # slot order of the ring
        got = p.predict(q, 0).astype(np.int64)
        assert got.shape == (k,) and np.isin(got, kept).all()
        slot = got % window
        np.testing.assert_array_equal(np.sort(sims[slot]), np.sort(sims)[-k:])


def test_nearest_ties_go_to_the_most_recent_records() -> None:
    rng = np.random.default_rng(1)
    dim, k = 16, 8
    p = SemanticHistoryPredictor(
        dim, SemanticHistoryParams(window=4000, min_matches=k, similarity_threshold=0.999)
    )
    dup = unit(*([1.0] * dim))
    others = _random_units(rng, 3000, dim)
    outputs: list[int] = []
    for i, v in enumerate(others):
        if i % 250 == 0:  # twelve identical prompts spread over the history
            p.observe(dup, 0, 10_000 + i)
            outputs.append(10_000 + i)
        p.observe(v, 0, i)
    query = unit(*([1.0] * (dim - 1)), 0.0)  # cosine 0.97 with dup: below the threshold
    got = np.sort(p.predict(query, 0))
    np.testing.assert_array_equal(got, np.sort(outputs)[-k:])


def test_input_length_neighbours_match_a_brute_force_scan() -> None:
    rng = np.random.default_rng(2)
    params = InputLengthParams(window=500, relative_tolerance=0.15, min_matches=0)
    p = InputLengthHistoryPredictor(params)
    rows = [(int(rng.integers(1, 2000)), int(rng.integers(1, 900))) for _ in range(800)]
    for n_in, n_out in rows:
        p.observe(None, n_in, n_out)
    kept = rows[-500:]
    for x in (1, 37, 400, 1999):
        want = sorted(o for i, o in kept if abs(i - x) <= 0.15 * max(x, 1))
        np.testing.assert_array_equal(np.sort(p.predict(None, x)), want)


def test_global_quantiles_follow_new_records() -> None:
    p = GlobalDistributionPredictor(HistoryParams(max_global_samples=4))
    for length in (10, 20, 30, 40):
        p.observe(None, 0, length)
    first = p.predict(None, 0)
    first[:] = -1.0  # a caller writing into its sample must not touch the next one
    np.testing.assert_array_equal(p.predict(None, 0), [10, 20, 30, 40])
    for length in (50, 60, 70, 80):
        p.observe(None, 0, length)
    np.testing.assert_array_equal(p.predict(None, 0), [20, 40, 60, 80])


def test_bucket_metrics() -> None:
    assert bucket_of(99).item() == 0 and bucket_of(100).item() == 1
    assert bucket_of(5000).item() == 19  # last bucket is open
    sample = np.array([50.0, 150.0, 160.0, 170.0])
    assert bucket_probability(sample, 120) == pytest.approx(0.75)
    assert median_bucket_hit(sample, 199)
    assert not median_bucket_hit(sample, 50)
    assert bucket_probability(np.array([]), 1) == 0.0


def _planted(
    rng: np.random.Generator, q: np.ndarray, cosines: list[float], dim: int
) -> list[np.ndarray]:
    """Unit vectors at the given cosines with ``q`` (random orthogonal parts)."""
    out = []
    for c in cosines:
        r = rng.standard_normal(dim).astype(np.float32)
        r -= float(r @ q) * q
        r /= np.linalg.norm(r)
        out.append((c * q + np.sqrt(1 - c * c) * r).astype(np.float32))
    return out


def test_fixed_projection_is_orthonormal_and_the_same_every_time() -> None:
    p = fixed_projection(384, 64)
    assert p.shape == (64, 384) and p.dtype == np.float32
    np.testing.assert_allclose(p @ p.T, np.eye(64), atol=1e-5)
    np.testing.assert_array_equal(p, fixed_projection(384, 64))


def test_compact_search_finds_the_exact_threshold_matches_and_nearest_records() -> None:
    """The compact scan agrees with the full scan where the records' ranks are clear.

    Background records are random (cosine about 0 ± 0.05 with the query); the
    planted ones sit just above and just below the threshold (inside the band
    re-scored exactly), and at moderate similarity for the nearest top-up.
    """
    rng = np.random.default_rng(7)
    dim = 384
    q = _random_units(rng, 1, dim)[0]
    background = _random_units(rng, 9_000, dim)
    above = _planted(rng, q, [0.81, 0.83, 0.86, 0.9, 0.95, 0.99], dim)
    below = _planted(rng, q, [0.72, 0.75, 0.78, 0.79], dim)
    compact = SemanticHistoryPredictor(dim, SemanticHistoryParams(min_matches=4))
    full = SemanticHistoryPredictor(dim, SemanticHistoryParams(min_matches=4, search_dim=None))
    assert compact.compact and not full.compact
    records = [*background[:4000], *above, *below, *background[4000:]]
    for i, v in enumerate(records):
        compact.observe(v, 0, i)
        full.observe(v, 0, i)
    want = set(range(4000, 4006))
    assert set(compact.predict(q, 0).astype(int)) == want
    assert set(full.predict(q, 0).astype(int)) == want
    assert compact.matches(q).shape == (6,)
    # Nearest top-up: no record reaches the threshold; the 8 planted ones are nearest.
    q2 = _random_units(rng, 1, dim)[0]
    near = _planted(rng, q2, [0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75], dim)
    p8 = SemanticHistoryPredictor(dim, SemanticHistoryParams(min_matches=8))
    for i, v in enumerate([*background[:5000], *near, *background[5000:]]):
        p8.observe(v, 0, i)
    assert set(p8.predict(q2, 0).astype(int)) == set(range(5000, 5008))


def test_search_dim_at_or_above_the_vector_dimension_scans_the_full_vectors() -> None:
    assert not SemanticHistoryPredictor(64, SemanticHistoryParams(search_dim=64)).compact
    assert not SemanticHistoryPredictor(32).compact
    assert SemanticHistoryPredictor(65).compact


@pytest.mark.parametrize("search_dim", [None, 64])
def test_nearest_floor_tops_up_with_the_prior_instead_of_far_records(
    search_dim: int | None,
) -> None:
    rng = np.random.default_rng(3)
    dim = 128
    q = _random_units(rng, 1, dim)[0]
    near = _planted(rng, q, [0.6, 0.65, 0.7], dim)
    far = _planted(rng, q, [0.0] * 50, dim)
    params = SemanticHistoryParams(min_matches=8, nearest_floor=0.5, search_dim=search_dim)
    p = SemanticHistoryPredictor(dim, params)
    for v in far:
        p.observe(v, 0, 1000)
    for v in near:
        p.observe(v, 0, 7)
    got = np.sort(p.predict(q, 0))
    # The 3 records above the floor, then 5 quantiles of the history's distribution.
    np.testing.assert_array_equal(got[:3], [7.0, 7.0, 7.0])
    np.testing.assert_array_equal(got[3:], np.full(5, 1000.0))
    no_floor = SemanticHistoryPredictor(dim, params.model_copy(update={"nearest_floor": -1.0}))
    for v in far:
        no_floor.observe(v, 0, 1000)
    for v in near:
        no_floor.observe(v, 0, 7)
    assert no_floor.predict(q, 0).shape == (8,)
