"""What the engine records for the EAGLE-3 head: features aligned with tokens, soft labels, the
training pairs built from them (the EAGLE alignment), and the bounded buffer."""

import random

import pytest
import torch
from eagle3_helpers import collect, random_head, random_prompts, target

from tailspec.drafter.eagle3 import Eagle3Sample, FeatureBuffer, SequenceRecorder
from tailspec.drafter.eagle3 import data as data_module
from tailspec.drafter.eagle3.train import collate, step_targets
from tailspec.kernels.transfers import QueuedCopy
from tailspec.rollout import SamplingParams


def reference_features(model, token_ids: list[int], layers) -> tuple[torch.Tensor, torch.Tensor]:
    """HF forward over the whole sequence: (inputs to ``layers`` concatenated ``[n, F]``, logits ``[n, V]``)."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    # hidden_states[i] is the input to layer i (0 = embeddings)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1), out.logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("strategy", ["none", "chain:3", "tree:3,2,6", "suffix:4"])
def test_recorded_features_are_the_targets_hidden_states_of_the_kept_tokens(arch, strategy):
    model = target(arch)
    head = random_head(model, std=0.02) if strategy == "none" else random_head(model)
    prompts = random_prompts(4, seed=3) + [[5, 6, 7, 5, 6, 7]] * 3  # a prompt group (forked prefill)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=4)
    engine, outs, buffer = collect(model, head, prompts, params, strategy=strategy)
    samples = buffer.samples()
    assert len(samples) == len(prompts)
    layers = head.config.aux_layer_ids
    by_tokens = {tuple(s.tokens.tolist()): s for s in samples}
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.completion_ids
        sample = by_tokens[tuple(ids)]
        assert sample.prompt_len == len(prompt)
        want, logits = reference_features(model, ids, layers)
        torch.testing.assert_close(sample.features, want[:-1], atol=1e-4, rtol=1e-4)
        # soft label of completion token j: the target's distribution after token j - 1
        probs = torch.softmax(logits[len(prompt) - 1 : len(ids) - 1], dim=-1)
        top = torch.topk(probs, sample.label_ids.shape[-1], dim=-1)
        torch.testing.assert_close(sample.label_probs, top.values, atol=1e-4, rtol=1e-4)
        assert (sample.label_ids[:, 0] == top.indices[:, 0]).all()
    if strategy != "none":
        assert engine.stats.drafted_tokens > 0


def test_features_survive_preemption():
    """A preempted sequence is recomputed from scratch; its record restarts and stays aligned."""
    model = target("qwen2")
    head = random_head(model)
    prompts = random_prompts(6, seed=8, min_len=10, max_len=20)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    engine, outs, buffer = collect(
        model, head, prompts, params, strategy="chain:2", kv_cache_tokens=160, block_size=4, max_num_seqs=6
    )
    assert engine.stats.preemptions > 0
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.completion_ids
        sample = next(s for s in buffer.samples() if s.tokens.tolist() == ids)
        want, _ = reference_features(model, ids, head.config.aux_layer_ids)
        torch.testing.assert_close(sample.features, want[:-1], atol=1e-4, rtol=1e-4)


def test_training_pairs_follow_the_eagle_alignment():
    """Feature at index t with token t + 1 predicts token t + 2; unrolled step k reads token
    t + k + 1 at position t + k and predicts token t + k + 2; prompt tokens are never targets."""
    n, prompt_len, feat = 12, 4, 3
    tokens = torch.arange(100, 100 + n)
    features = torch.arange(n - 1, dtype=torch.float32).view(-1, 1).repeat(1, feat)  # row t holds t
    sample = Eagle3Sample(tokens, features, prompt_len)
    batch = collate([sample], ttt_steps=3, max_tokens=64, rng=random.Random(0))
    assert batch.features[0, :, 0].tolist() == list(range(n - 1))
    assert batch.positions[0].tolist() == list(range(n - 1))

    class Identity:  # a head whose draft vocabulary is the whole target vocabulary
        fc = torch.nn.Linear(1, 1)

        @staticmethod
        def target_to_draft_ids(ids):
            return ids

    for k in range(3):
        target_ids, ok = step_targets(Identity, batch, k)
        for t in range(n - 1):
            inp = batch.tokens[0, t + k + 1].item()
            if ok[0, t]:
                assert target_ids[0, t].item() == 100 + t + k + 2  # token t + k + 2
                assert inp == 100 + t + k + 1
                assert t + k + 2 >= prompt_len
        # every completion token reachable at this step is a target exactly once
        expected = [t for t in range(n - 1) if prompt_len <= t + k + 2 <= n - 1]
        assert ok[0].nonzero().flatten().tolist() == expected


def test_recorder_drops_sequences_with_gaps_and_restarts_on_recompute():
    rec = SequenceRecorder(label_topk=2)
    f = torch.randn(5, 4)
    logits = torch.randn(1, 10)
    rec.observe(0, 3, 0, f[:3], logits)
    rec.observe(0, 3, 5, f[3:5], logits)  # positions 3 and 4 were never seen
    assert rec.finish(0, list(range(7))) is None
    rec.observe(1, 3, 0, f[:3], logits)
    rec.observe(1, 3, 3, f[3:4], logits)
    rec.observe(1, 3, 0, f[:4], logits)  # recomputed after a preemption
    rec.observe(1, 3, 4, f[4:5], logits)
    sample = rec.finish(1, list(range(6)))
    torch.testing.assert_close(sample.features, f[:5])
    with pytest.raises(ValueError, match="label_topk"):
        SequenceRecorder(label_topk=-1)
    with pytest.raises(ValueError, match="dtype"):
        SequenceRecorder(dtype=torch.int64)


class _HeldCopy(QueuedCopy):
    """A copy that has not landed until waited for (a device running behind the host); logs waits."""

    waited: list[int] = []

    def ready(self) -> bool:
        return False

    def result(self):
        _HeldCopy.waited.append(id(self))
        return super().result()


def test_recorder_waits_only_for_the_copies_a_finished_sequence_needs(monkeypatch):
    """One queued copy per forward for the whole batch; a finish waits for the copies holding its
    sequence's tokens and not for a later forward's (an overlapped row past its last token), and
    what it records equals the rows and top-k labels it was given."""
    monkeypatch.setattr(data_module, "QueuedCopy", _HeldCopy)
    monkeypatch.setattr(_HeldCopy, "waited", [])
    rec = SequenceRecorder(label_topk=2)
    feats, logits = torch.randn(3, 5, 4), torch.randn(3, 5, 10)
    # forward 0: prefill of sequences 0 (3 prompt tokens) and 1 (2); forwards 1 and 2: one row each
    rec.observe_batch([(0, 3, 0, 3, 1), (1, 2, 0, 2, 1)], feats[0], logits[0, :2])
    for f in (1, 2):
        rec.observe_batch([(0, 3, 3 + f - 1, 1, 1), (1, 2, 2 + f - 1, 1, 1)], feats[f, :2], logits[f, :2])
    assert len(rec._queued) == 3 and _HeldCopy.waited == []
    sample = rec.finish(0, [5, 6, 7, 8, 9])  # 4 feature rows: forwards 0 and 1; forward 2's row is past it
    assert len(_HeldCopy.waited) == 2 and len(rec._queued) == 1
    torch.testing.assert_close(sample.features, torch.cat([feats[0, :3], feats[1, :1]]))
    want_probs, want_ids = torch.topk(torch.softmax(torch.stack([logits[0, 0], logits[1, 0]]), -1), 2)
    assert torch.equal(sample.label_ids, want_ids)
    torch.testing.assert_close(sample.label_probs, want_probs)
    sample = rec.finish(1, [1, 2, 3, 4, 5])  # rows 0-3: forward 2's copy now
    assert len(_HeldCopy.waited) == 3 and not rec._queued
    torch.testing.assert_close(sample.features, torch.cat([feats[0, 3:5], feats[1, 1:2], feats[2, 1:2]]))
    for f in range(SequenceRecorder._MAX_QUEUED + 2):  # a device far behind: the oldest is waited for
        rec.observe_batch([(2, 1, f, 1, 1)], feats[0, :1], logits[0, :1])
    assert len(rec._queued) == SequenceRecorder._MAX_QUEUED


def _sample(n: int, feat: int = 8) -> Eagle3Sample:
    return Eagle3Sample(torch.arange(n), torch.zeros(n - 1, feat), 1)


@pytest.mark.parametrize("policy", ["recent", "reservoir"])
def test_buffer_respects_its_byte_cap(policy):
    one = _sample(10).nbytes
    buf = FeatureBuffer(max_bytes=5 * one, policy=policy, seed=0)
    for _ in range(100):
        buf.add(_sample(10))
        assert buf.nbytes <= 5 * one
    assert len(buf) == 5 and buf.num_seen == 100
    assert not buf.add(_sample(100))  # larger than the whole cap


def test_recent_keeps_the_newest_and_reservoir_keeps_a_uniform_sample():
    recent = FeatureBuffer(max_bytes=10 * _sample(5).nbytes, policy="recent")
    for i in range(50):
        recent.add(Eagle3Sample(torch.full((5,), i), torch.zeros(4, 8), 1))
    assert sorted(int(s.tokens[0]) for s in recent.samples()) == list(range(40, 50))
    early = 0
    for seed in range(200):
        res = FeatureBuffer(max_bytes=10 * _sample(5).nbytes, policy="reservoir", seed=seed)
        for i in range(50):
            res.add(Eagle3Sample(torch.full((5,), i), torch.zeros(4, 8), 1))
        early += sum(int(s.tokens[0]) < 25 for s in res.samples())
    assert 0.4 < early / (200 * 10) < 0.6  # half the stream is "early"; a uniform sample keeps ~half


def test_bad_buffer_settings_are_refused():
    with pytest.raises(ValueError, match="policy"):
        FeatureBuffer(policy="lifo")
    with pytest.raises(ValueError, match="max_bytes"):
        FeatureBuffer(max_bytes=0)
    with pytest.raises(ValueError, match="feature rows"):
        Eagle3Sample(torch.arange(5), torch.zeros(5, 2), 1)
    with pytest.raises(ValueError, match="prompt_len"):
        Eagle3Sample(torch.arange(5), torch.zeros(4, 2), 5)
