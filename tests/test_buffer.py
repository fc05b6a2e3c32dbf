"""ReplayBuffer rules (docs/algorithm.md section 3), with fixed seeds and numbers worked out by hand."""

from __future__ import annotations

import collections
import itertools
import json
import math

import pytest

from tba.buffer import ReplayBuffer
from tba.config import BufferConfig
from tba.types import Sample

_ids = itertools.count(1000)


def make_buffer(seed: int = 0, **fields) -> ReplayBuffer:
    """A buffer from a ``buffer`` config section with ``fields`` changed from the defaults."""
    return ReplayBuffer(BufferConfig(**fields), seed)


def mk(prompt_id: int, version: int, reward: float = 0.0, response_ids: list[int] | None = None) -> Sample:
    """A sample with a unique response (unless ``response_ids`` is given)."""
    resp = response_ids if response_ids is not None else [next(_ids)]
    return Sample(
        prompt_id=prompt_id,
        prompt_ids=[prompt_id],
        response_ids=resp,
        reward=reward,
        logprobs=[-0.5] * len(resp),
        ref_logprobs=[-0.7] * len(resp),
        policy_version=version,
    )


def versions(buf: ReplayBuffer, prompt_id: int) -> list[int]:
    return sorted(s.policy_version for s in buf.responses(prompt_id))


# ---------------------------------------------------------------------- storage


def test_dedup_keeps_newest_copy():
    buf = make_buffer(capacity_per_prompt=10)
    assert buf.add([mk(0, 1, response_ids=[7, 8, 9]), mk(0, 1, response_ids=[7, 8])]) == 2
    assert buf.add([mk(0, 3, reward=1.0, response_ids=[7, 8, 9])]) == 1
    assert len(buf) == 2 and buf.num_prompts == 1
    copies = [s for s in buf.responses(0) if s.response_ids == [7, 8, 9]]
    assert len(copies) == 1
    assert copies[0].policy_version == 3 and copies[0].reward == 1.0
    # the same response to a different prompt is a different sample
    buf.add([mk(1, 1, response_ids=[7, 8, 9])])
    assert len(buf) == 3 and buf.num_prompts == 2


def test_eviction_oldest_version_first_ties_by_insertion():
    buf = make_buffer(capacity_per_prompt=3)
    for v in (5, 1, 3):
        buf.add([mk(0, v)])
    assert buf.add([mk(0, 2)]) == 1
    assert versions(buf, 0) == [2, 3, 5]  # version 1 evicted first
    buf.add([mk(0, 4)])
    assert versions(buf, 0) == [3, 4, 5]  # then version 2
    assert buf.add([mk(0, 0)]) == 0  # older than everything stored: evicted at once
    assert versions(buf, 0) == [3, 4, 5] and len(buf) == 3
    # ties on version: the earliest inserted goes first
    buf = make_buffer(capacity_per_prompt=2)
    a, b, c = mk(0, 1), mk(0, 1), mk(0, 1)
    buf.add([a, b, c])
    kept = [s.response_ids for s in buf.responses(0)]
    assert kept == [b.response_ids, c.response_ids]


def test_len_num_prompts_stats():
    buf = make_buffer()
    assert len(buf) == 0 and buf.num_prompts == 0
    assert "buffer/version_min" not in buf.stats()
    buf.add([mk(0, 2), mk(0, 4), mk(3, 6)])
    buf.sync(min_version=4)
    st = buf.stats()
    assert st["buffer/size"] == 3 and st["buffer/prompts"] == 2
    assert st["buffer/recent_prompts"] == 2 and st["buffer/recent_samples"] == 2  # version 2 is too old
    assert st["buffer/version_min"] == 2 and st["buffer/version_max"] == 6


# ---------------------------------------------------------------------- sync and the on-policy branch


def test_on_policy_draws_only_newest_sync_recent_set():
    buf = make_buffer(on_policy_prob=1.0, seed=3)
    buf.add([mk(p, 0) for p in range(5) for _ in range(3)])
    assert buf.sync(min_version=0) == 5
    buf.add([mk(p, 1) for p in (5, 6) for _ in range(3)])
    assert buf.sync(min_version=1) == 2
    buf.add([mk(7, 2) for _ in range(3)])  # arrived after the sync: not recent yet
    seen = collections.Counter()
    for step in range(200):
        batch = buf.sample(num_prompts=3, group_size=2, step=step)
        assert batch.metrics["buffer/on_policy_frac"] == 1.0
        seen.update(s.prompt_id for s in batch.samples)
    assert set(seen) == {5, 6}
    # the pass over the recent set is without replacement: 2 prompts, 600 draws -> exactly 300 each
    assert seen[5] == seen[6] == 600


def test_sync_keeps_previous_recent_set_when_nothing_fresh():
    buf = make_buffer(on_policy_prob=1.0)
    buf.add([mk(0, 4), mk(0, 4)])
    assert buf.sync(min_version=4) == 1
    buf.add([mk(1, 2), mk(1, 2)])  # only stale samples arrive
    assert buf.sync(min_version=6) == 1  # previous set kept
    assert {s.prompt_id for s in buf.sample(4, 2, step=8).samples} == {0}


def test_recent_draw_is_newest_first():
    buf = make_buffer(on_policy_prob=1.0)
    buf.add([mk(0, v) for v in (3, 5, 4, 9)])
    buf.sync(min_version=3)
    buf.add([mk(0, 10)])  # pending, not recent
    batch = buf.sample(1, 3, step=10)
    assert [s.policy_version for s in batch.samples] == [9, 5, 4]
    assert batch.metrics["buffer/staleness_max"] == 6.0
    assert batch.metrics["buffer/staleness_mean"] == pytest.approx((1 + 5 + 6) / 3)


def test_fewer_than_k_samples_uses_replacement():
    # off-policy branch: K=4 from 2 samples
    buf = make_buffer(on_policy_prob=0.0, seed=1)
    a, b = mk(0, 1), mk(0, 1)
    buf.add([a, b])
    seen = set()
    for step in range(20):
        batch = buf.sample(1, 4, step=step)
        assert len(batch.samples) == 4 and batch.num_prompts == 1
        ids = [tuple(s.response_ids) for s in batch.samples]
        assert set(ids) <= {tuple(a.response_ids), tuple(b.response_ids)}
        seen.update(ids)
    assert len(seen) == 2
    # on-policy branch: both recent samples first (newest first), the remaining 2 drawn from them
    buf = make_buffer(on_policy_prob=1.0, seed=1)
    a, b = mk(0, 1), mk(0, 2)
    buf.add([a, b])
    buf.sync(min_version=0)
    got = buf.sample(1, 4, step=3).samples
    assert got[0] is b and got[1] is a and all(s in (a, b) for s in got[2:])


# ---------------------------------------------------------------------- the off-policy branch


def _frequencies(inv_temp: float, draws: int = 4000) -> list[float]:
    buf = make_buffer(on_policy_prob=0.0, inv_temp=inv_temp, seed=0)
    samples = [mk(0, 0, reward=r, response_ids=[i]) for i, r in enumerate([0.0, 0.0, 1.0, 1.0])]
    buf.add(samples)
    counts = collections.Counter()
    for _ in range(draws):
        counts[buf.sample(1, 1, step=0).samples[0].response_ids[0]] += 1
    return [counts[i] / draws for i in range(4)]


def test_off_policy_inv_temp_zero_is_uniform():
    freqs = _frequencies(inv_temp=0.0)
    chi2 = sum((f * 4000 - 1000) ** 2 / 1000 for f in freqs)
    assert chi2 < 16.27  # chi-square, 3 dof, p = 0.001; rewards [0, 0, 1, 1] must not matter
    assert all(abs(f - 0.25) < 0.03 for f in freqs)


def test_off_policy_inv_temp_one_matches_softmax_of_rewards():
    freqs = _frequencies(inv_temp=1.0)
    low, high = 1 / (2 + 2 * math.e), math.e / (2 + 2 * math.e)  # 0.1345, 0.3655
    expected = [low, low, high, high]
    assert all(abs(f - p) < 0.03 for f, p in zip(freqs, expected))
    chi2 = sum((f - p) ** 2 * 4000 / p for f, p in zip(freqs, expected))
    assert chi2 < 16.27


@pytest.mark.parametrize("inv_temp", [0.0, 5.0])
def test_off_policy_without_replacement_when_enough_samples(inv_temp: float):
    buf = make_buffer(on_policy_prob=0.0, inv_temp=inv_temp, seed=2)
    buf.add([mk(0, 0, reward=r) for r in (0.0, 0.0, 1.0, 3.0)])
    for step in range(20):
        ids = [tuple(s.response_ids) for s in buf.sample(1, 4, step=step).samples]
        assert len(set(ids)) == 4


def test_off_policy_epoch_over_prompts_without_replacement():
    buf = make_buffer(on_policy_prob=0.0, seed=4)
    buf.add([mk(p, 0) for p in range(5) for _ in range(2)])
    for step in range(3):
        batch = buf.sample(5, 2, step=step)
        assert batch.metrics["buffer/on_policy_frac"] == 0.0
        prompts = [s.prompt_id for s in batch.samples[::2]]
        assert sorted(prompts) == [0, 1, 2, 3, 4]
        assert batch.samples[0].prompt_id == batch.samples[1].prompt_id  # group-major
    # a prompt added mid-epoch joins the next epoch, not the current one
    first = {s.prompt_id for s in buf.sample(3, 1, step=3).samples}
    buf.add([mk(5, 1)])
    rest = {s.prompt_id for s in buf.sample(2, 1, step=4).samples}
    assert first | rest == {0, 1, 2, 3, 4} and 5 not in rest
    assert sorted(s.prompt_id for s in buf.sample(6, 1, step=5).samples) == [0, 1, 2, 3, 4, 5]


def test_empty_recent_set_falls_back_to_all_prompts():
    buf = make_buffer(on_policy_prob=1.0)
    buf.add([mk(0, 0), mk(1, 0)])  # no sync yet
    batch = buf.sample(2, 1, step=0)
    assert batch.metrics["buffer/on_policy_frac"] == 0.0
    assert sorted(s.prompt_id for s in batch.samples) == [0, 1]


def test_mixing_frequencies_for_m_between_0_and_1():
    """0 < m < 1: the share of batch prompts that come from the newest sync's recent set, worked out by hand.

    P = 12 prompts; the newest sync's recent set is prompts 9-11 (R = 3); m = 0.3; N = 8000 batches of one
    prompt (B = K = 1), so ``buffer/on_policy_frac`` (0 or 1) names each draw's branch.
    - Each draw takes the recent branch with probability m, independently: N_on ~ Binomial(N, m), mean
      N m = 2400, sigma = sqrt(N m (1 - m)) = sqrt(1680) = 41.0, so |N_on - 2400| <= 4 sigma = 164.
    - The other draws walk shuffled epochs over ALL P prompts (recent ones included), without replacement:
      over N_off draws every prompt comes up floor(N_off / P) or floor(N_off / P) + 1 times, so the recent
      prompts get N_off R / P + e off-policy draws with |e| <= R (P - R) / P = 2.25 (the partial epoch).
    - The recent prompts' share is S = (N_on + N_off R / P + e) / N = R / P + (N_on / N)(1 - R / P) + e / N,
      so E[S] = m + (1 - m) R / P = 0.3 + 0.7 * 0.25 = 0.475 and
      |S - 0.475| <= 4 * 41.0 * 0.75 / 8000 + 2.25 / 8000 = 0.0154 + 0.0003.
      (m ignored as 1 gives S = 1; m = 0 gives 0.25; an off-policy branch over the non-recent prompts only
      gives 0.3; m and 1 - m swapped give 0.775.)
    - With B = 4 the m-coin is tossed per prompt, not per batch: a batch has j recent-branch prompts with
      probability C(4, j) 0.3^j 0.7^(4-j); j = 2: 6 * 0.09 * 0.49 = 0.2646, so over 2000 batches
      2000 * 0.2646 = 529.2 +- 4 * sqrt(2000 * 0.2646 * 0.7354) = 4 * 19.7 = 78.9 (a per-batch coin: 0).
    """
    m, n_prompts, n_draws = 0.3, 12, 8000
    buf = make_buffer(on_policy_prob=m, seed=5)
    buf.add([mk(p, 0) for p in range(9) for _ in range(2)])
    buf.sync(min_version=0)
    buf.add([mk(p, 1) for p in (9, 10, 11) for _ in range(2)])
    assert buf.sync(min_version=1) == 3  # the newest recent set: prompts 9, 10, 11
    recent = {9, 10, 11}
    on, off = collections.Counter(), collections.Counter()
    for step in range(n_draws):
        batch = buf.sample(1, 1, step=step)
        (on if batch.metrics["buffer/on_policy_frac"] == 1.0 else off)[batch.samples[0].prompt_id] += 1
    n_on, n_off = sum(on.values()), sum(off.values())
    assert abs(n_on - n_draws * m) <= 4 * math.sqrt(n_draws * m * (1 - m))  # 164.0
    assert set(on) == recent  # the recent branch draws only the newest sync's prompts
    assert set(off) == set(range(n_prompts)) and max(off.values()) - min(off.values()) <= 1  # epochs
    off_recent = sum(off[p] for p in recent)
    assert 0 <= off_recent - len(recent) * (n_off // n_prompts) <= len(recent)  # R per full epoch
    share = (n_on + off_recent) / n_draws
    r_frac = len(recent) / n_prompts
    bound = 4 * math.sqrt(n_draws * m * (1 - m)) * (1 - r_frac) / n_draws + 3 * (1 - r_frac) / n_draws
    assert abs(share - (m + (1 - m) * r_frac)) <= bound  # 0.475 +- 0.0157

    per_batch = collections.Counter(buf.sample(4, 1, step=n_draws + i).metrics["buffer/on_policy_frac"]
                                    for i in range(2000))
    p2 = 6 * m**2 * (1 - m) ** 2  # 0.2646
    assert abs(per_batch[0.5] - 2000 * p2) <= 4 * math.sqrt(2000 * p2 * (1 - p2))  # 529.2 +- 78.9


# ---------------------------------------------------------------------- the async staleness bound


@pytest.mark.parametrize("k", [1, 2, 4])
def test_staleness_bound_2k_minus_1(k: int):
    """Searcher lag up to k-1 steps plus an old straggler; recent draws stay <= 2k-1 stale."""
    buf = make_buffer(on_policy_prob=1.0, seed=k)
    buf.add([mk(p, 0) for p in range(6) for _ in range(3)])  # initial fill with version 0
    arrivals: dict[int, list[Sample]] = collections.defaultdict(list)
    straggler_step = 3 * k + 1
    stale_prompt = 99  # a prompt that only ever gets the straggler's samples
    straggler = [mk(stale_prompt, 0) for _ in range(3)] + [mk(p, 0) for p in range(6)]
    arrivals[straggler_step] += straggler
    straggler_ids = {tuple(s.response_ids) for s in straggler}
    published = 0
    worst = 0
    for t in range(12 * k):
        buf.add(arrivals.pop(t, []))
        if t % k == 0:
            published = t  # trainer publishes weights of step t and syncs the buffer
            assert buf.sync(min_version=t - k) >= 1
        batch = buf.sample(num_prompts=3, group_size=2, step=t)
        assert batch.metrics["buffer/on_policy_frac"] == 1.0
        for s in batch.samples:
            assert s.prompt_id != stale_prompt
            assert tuple(s.response_ids) not in straggler_ids
            worst = max(worst, t - s.policy_version)
        assert batch.metrics["buffer/staleness_max"] <= 2 * k - 1
        # searcher generates with the latest published version; it lands 1..k steps later
        lag = 1 + (t * 7 + 3) % k  # deterministic lags covering 1..k
        arrivals[t + lag] += [mk(t % 6, published) for _ in range(3)]
    assert worst <= 2 * k - 1
    assert worst == 2 * k - 1  # the bound is tight in this loop
    assert buf.responses(stale_prompt)  # the straggler did arrive; it was just never drawn as recent


# ---------------------------------------------------------------------- checkpointing


def test_state_dict_round_trip_reproduces_future_batches():
    def build() -> ReplayBuffer:
        buf = make_buffer(capacity_per_prompt=4, on_policy_prob=0.5, inv_temp=1.0, seed=11)
        buf.add([mk(p, v, reward=float((p + v) % 3), response_ids=[p, v, j])
                 for p in range(6) for v in range(3) for j in range(2)])
        buf.sync(min_version=1)
        for step in range(3):
            buf.sample(4, 3, step=step)
        buf.add([mk(p, 3, reward=1.0, response_ids=[p, 3]) for p in (1, 2)])  # pending at save time
        return buf

    original = build()
    state = json.loads(json.dumps(original.state_dict()))
    copy = make_buffer(capacity_per_prompt=4, on_policy_prob=0.5, inv_temp=1.0, seed=999)
    copy.load_state_dict(state)
    assert len(copy) == len(original) and copy.stats() == original.stats()

    def key(batch):
        return [(s.prompt_id, tuple(s.response_ids), s.policy_version) for s in batch.samples]

    for step in range(3, 8):
        a, b = original.sample(5, 3, step=step), copy.sample(5, 3, step=step)
        assert key(a) == key(b) and a.metrics == b.metrics
    for buf in (original, copy):  # pending samples and the seq counter survive too
        buf.add([mk(p, 4, response_ids=[p, 4]) for p in (0, 5)])
        buf.sync(min_version=3)
    assert key(original.sample(6, 2, step=8)) == key(copy.sample(6, 2, step=8))
    assert original.stats() == copy.stats()


def test_load_state_dict_rejects_bad_state():
    with pytest.raises(ValueError, match="format"):
        make_buffer().load_state_dict({"format": 42})
    state = make_buffer().state_dict()
    del state["rng"]
    with pytest.raises(ValueError, match="rng"):
        make_buffer().load_state_dict(state)


# ---------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"capacity_per_prompt": 0}, "capacity_per_prompt"),
        ({"on_policy_prob": 1.5}, "on_policy_prob"),
        ({"on_policy_prob": -0.1}, "on_policy_prob"),
        ({"inv_temp": -1.0}, "inv_temp"),
        ({"inv_temp": float("inf")}, "inv_temp"),
    ],
)
def test_bad_constructor_args_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BufferConfig(**kwargs)


def test_bad_sample_args_raise():
    buf = make_buffer()
    with pytest.raises(ValueError, match="empty"):
        buf.sample(1, 1, step=0)
    buf.add([mk(0, 0)])
    with pytest.raises(ValueError, match="num_prompts"):
        buf.sample(0, 1, step=0)
    with pytest.raises(ValueError, match="group_size"):
        buf.sample(1, 0, step=0)
    with pytest.raises(TypeError):
        buf.add([{"prompt_id": 0}])


def test_reuse_counts_hand_counted():
    """buffer/reuse_*: how many times each trained sample has been drawn, counted by hand.

    m = 1, one prompt with samples a (v0) and b (v1) in the recent set, K = 2: every batch takes both, so
    after batch n each has been drawn n times. A third sample c (v2) is then the whole recent set (only
    samples added since the previous sync join it): the batch tops up with replacement, [c, c], so c has
    been drawn twice; a restored buffer continues the count (4 after the next [c, c])."""
    buf = make_buffer(on_policy_prob=1.0, capacity_per_prompt=2)
    buf.add([mk(0, 0), mk(0, 1)])
    buf.sync(0)
    for n in (1, 2):
        m = buf.sample(1, 2, step=2).metrics
        assert (m["buffer/reuse_mean"], m["buffer/reuse_max"]) == (n, n)
    buf.add([mk(0, 2)])  # capacity 2: evicts a (v0)
    buf.sync(2)
    m = buf.sample(1, 2, step=3).metrics
    assert (m["buffer/reuse_mean"], m["buffer/reuse_max"]) == (2.0, 2.0)
    # the counts survive a checkpoint round trip
    restored = make_buffer(on_policy_prob=1.0, capacity_per_prompt=2)
    restored.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert restored.sample(1, 2, step=4).metrics["buffer/reuse_max"] == 4.0
