import pytest
import torch
import trl

import tailspec
from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.drafter.eagle3.checkpoint import load_checkpoint
from tailspec.rollout.model.layer_taps import capture_layer_inputs
from tailspec.trainer_hooks import SpecRollout
from tailspec.trainer_hooks.drafter_from_trainer import DrafterFromTrainer, capture_final_hidden, samples_from_forward

LAYERS = (1, 1, 0)


def make_head(policy) -> Eagle3Head:
    torch.manual_seed(0)
    cfg = Eagle3Config.for_target(policy.config, aux_layer_ids=LAYERS)
    return Eagle3Head(cfg)


def unpadded_reference(policy, tokens: torch.Tensor, prompt_len: int, k: int):
    """Features and top-k soft labels of one sequence from a plain, unpadded forward."""
    with torch.no_grad(), capture_layer_inputs(policy, LAYERS) as captured:
        logits = policy(tokens[None]).logits[0]
    features = torch.cat([captured[i][0] for i in LAYERS], dim=-1)[:-1]
    probs = torch.softmax(logits[prompt_len - 1 : -1].float(), dim=-1)
    return features, torch.topk(probs, k, dim=-1)


def test_samples_from_trls_padded_layout_match_an_unpadded_forward(tiny_policy):
    prompts = [[5, 6, 7, 8], [9, 10]]
    completions = [[11, 12, 13], [14, 15, 16, 17, 18]]
    width_p, width_c = 4, 5
    ids = torch.zeros(2, width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, width_p - len(p) : width_p] = torch.tensor(p)
        ids[b, width_p : width_p + len(c)] = torch.tensor(c)
        mask[b, width_p - len(p) : width_p + len(c)] = 1
    with (
        torch.no_grad(),
        capture_layer_inputs(tiny_policy, LAYERS) as captured,
        capture_final_hidden(tiny_policy) as final,
    ):
        tiny_policy(input_ids=ids, attention_mask=mask)
    features = torch.cat([captured[i] for i in LAYERS], dim=-1)
    head = tiny_policy.get_output_embeddings()
    samples = samples_from_forward(ids, mask, width_c, features, final[0], head, label_topk=4)
    assert len(samples) == 2
    for sample, p, c in zip(samples, prompts, completions):
        assert sample.tokens.tolist() == p + c and sample.prompt_len == len(p)
        ref_features, ref_top = unpadded_reference(tiny_policy, sample.tokens, len(p), 4)
        assert torch.allclose(sample.features, ref_features, atol=1e-4)
        assert torch.equal(sample.label_ids, ref_top.indices)
        assert torch.allclose(sample.label_probs, ref_top.values, atol=1e-5)


def test_rows_out_of_layout_are_skipped(tiny_policy):
    ids = torch.tensor([[0, 5, 6, 7, 0], [5, 0, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 1, 1, 1]])  # row 0: empty completion; row 1: a hole
    features = torch.zeros(2, 5, 8)
    assert samples_from_forward(ids, mask, 2, features, None, None, label_topk=0) == []


def _trainer(common, cls, **kwargs):
    if cls is trl.GRPOTrainer:
        return trl.GRPOTrainer(**common)
    return tailspec.GRPOTrainer(**common, **kwargs)


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (trl.GRPOTrainer, {}),  # stock generation: the tap does not care who generated
        (tailspec.GRPOTrainer, {}),  # fused IS: one forward per step
        (tailspec.GRPOTrainer, {"fuse_importance_forward": False}),  # TRL's no-grad forward is not tapped
    ],
    ids=["stock-trl", "tailspec-fused", "tailspec-trl-is-forward"],
)
def test_head_trains_on_the_trainers_forwards(common, tiny_policy, tmp_path, cls, kwargs):
    head = make_head(tiny_policy)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    trainer = _trainer(common, cls, **kwargs)
    tap = DrafterFromTrainer(head, trainer, train_steps=3, save_to=tmp_path / "head")
    trainer.train()
    # 2 optimizer steps x 8 completions, each recorded once
    assert tap.samples_recorded == 16 and len(tap.buffer) == 16
    assert head.version == 6 and tap.drafter_trainer.step_count == 6
    assert any(not torch.equal(before[k], v) for k, v in head.state_dict().items())
    logged = [h for h in trainer.state.log_history if "drafter/loss" in h]
    assert len(logged) == 2 and logged[-1]["drafter/version"] == 6 and logged[-1]["drafter/samples"] == 16
    saved = load_checkpoint(tmp_path / "head", target_config=tiny_policy.config)
    assert saved.version == 6


def test_repeated_batches_are_recorded_once(common, tiny_policy):
    """num_iterations = 2: each batch's loss forward runs twice; its samples go in once."""
    common["args"].num_iterations = 2
    head = make_head(tiny_policy)
    trainer = tailspec.GRPOTrainer(**common)
    tap = DrafterFromTrainer(head, trainer, train_steps=1)
    trainer.train()
    assert trainer.state.global_step == 2 and tap.samples_recorded == 8


def test_the_engine_drafts_with_the_head_the_trainer_trains(common, tiny_policy):
    head = make_head(tiny_policy)
    rollout = SpecRollout(strategy="chain:2", drafter=head)
    trainer = tailspec.GRPOTrainer(**common, rollout=rollout)
    DrafterFromTrainer(head, trainer, train_steps=2)
    published = []
    publish = rollout.publish_drafter
    rollout.publish_drafter = lambda h: published.append((h, h.version, publish(h)))
    trainer.train()
    assert rollout.engine.drafter.head is head and head.version == 4
    assert rollout.history[-1].drafted_tokens > 0
    # offered to the rollout after every optimizer step; the colocated engine needs no copy
    assert [version for _, version, _ in published] == [2, 4]
    assert all(h is head and not sent for h, _, sent in published)
    assert not rollout.publish_drafter(make_head(tiny_policy))  # not the head it drafts with


def test_argument_checks(common, tiny_policy):
    trainer = tailspec.GRPOTrainer(**common)
    with pytest.raises(ValueError, match="Eagle3Head"):
        DrafterFromTrainer(torch.nn.Linear(2, 2), trainer)
    with pytest.raises(ValueError, match="train_steps"):
        DrafterFromTrainer(make_head(tiny_policy), trainer, train_steps=-1)
    with pytest.raises(ValueError, match="buffer_mb"):
        DrafterFromTrainer(make_head(tiny_policy), trainer, buffer_mb=0)


def test_grouped_forwards_record_the_samples_a_padded_forward_does(common, make_policy, varied_length_rollout):
    """Length-grouped loss forwards (several narrower forwards per call) give the tap the same
    samples as one padded forward: each forward is cut in its own layout."""
    recorded = []
    for grouped in (False, True):
        policy = make_policy()
        trainer = tailspec.GRPOTrainer(
            **{**common, "model": policy},
            rollout=varied_length_rollout(),
            length_grouped_forward=grouped,
            length_group_overhead_tokens=0,
        )
        tap = DrafterFromTrainer(make_head(policy), trainer, train_steps=0)
        trainer.train()
        recorded.append(sorted(tap.buffer._samples, key=lambda s: s.tokens.tolist()))
    padded, grouped = recorded
    assert len(padded) == len(grouped) == 16
    for a, b in zip(padded, grouped):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=1e-4)
        assert torch.equal(a.label_ids, b.label_ids)
