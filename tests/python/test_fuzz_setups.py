"""Whole training set-ups against one device (tests/fuzz/setups.py): a model (the
project's GPT and Llama, Hugging Face Llama, Qwen2, GPT-2 and BERT), a ``vescale.Plan``
over 4 ranks (pipeline, tensor and sequence, data parallelism, ZeRO 0-3, accumulation,
clipping, recomputation), an optimizer (SGD, momentum, AdamW, parameter groups, fused
Adam), an LR scheduler, shuffled data, evaluation between steps and a checkpoint resumed
under another plan, and what differs between ranks (an uneven, possibly empty, share of
a drop_last=False last batch, a pipeline's refusal of it, a data-dependent branch some
DP ranks skip: tests/fuzz/rank_differences.py); the losses of every step, the
evaluation losses and the trained weights are compared.

First the set-ups that found bugs (shrunk, as literals), then short campaigns with fixed
seeds on 4 ranks and on 3 (VESCALE_FUZZ_SETUPS and VESCALE_FUZZ_SETUP_SEED pick others
for the first). The long campaign is ``python -m tests.fuzz.setup_campaign --setups 1000
[--world 6]`` (docs/setup_fuzzing.md)."""

from __future__ import annotations

import os

from tests.fuzz.setup_campaign import campaign, run_literals

# Each: what it found, then the set-up.
REGRESSIONS = [
    # Hang: recomputation (saved-tensor hooks in the thread's autograd state) and a
    # collective reached from indexing (GIL held): gloo's thread waited for the GIL.
    ("recompute under TP4, rotary slice gathers",
     {"model": {"kind": "llama", "width": 16, "heads": 2, "vocab": 64, "layers": 1, "kv_heads": 1},
      "plan": {"mesh": {"TP": 4}, "recompute.modules": [r"model\.layers\.0"]},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 2, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 642, "data_seed": 888}),
    # Exception: a pipeline's dry run took the zeros standing in for the embedding's
    # output as this rank's sequence shard (the stream twice as long under TP2 + SP).
    ("pipeline with sequence parallelism",
     {"model": {"kind": "gpt", "width": 12, "heads": 2, "vocab": 48, "layers": 2, "bias": False},
      "plan": {"mesh": {"PP": 2, "TP": 2}, "pipeline_parallel.microbatches": 4, "pipeline_parallel.schedule": "1f1b",
               "pipeline_parallel.split_method": "uniform", "pipeline_parallel.virtual_stages": 1,
               "tensor_parallel.sequence_parallel": True},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 8, "batch": 8, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 536, "data_seed": 301}),
    # Hang: ZeRO-3 over a DP dim of one rank, with a TP shard left empty (6 rows over
    # 4 ranks): its chunk was 0 and one rank divided by it while the others waited.
    ("ZeRO-3 of an empty tensor-parallel shard",
     {"model": {"kind": "llama", "width": 12, "heads": 2, "vocab": 70, "layers": 1, "kv_heads": 1},
      "plan": {"mesh": {"DP": 1, "TP": 4}, "data_parallel.zero_stage": 3},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 8, "batch": 8, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 373, "data_seed": 249}),
    # Exception, then a hang: a zero-bubble schedule's weight-gradient pass under ZeRO-3
    # read parameters that a later micro-batch's forward had emptied again.
    ("ZeRO-3 with a zero-bubble schedule",
     {"model": {"kind": "gpt", "width": 12, "heads": 2, "vocab": 70, "layers": 4, "bias": False},
      "plan": {"mesh": {"DP": 2, "PP": 2}, "data_parallel.zero_stage": 3, "pipeline_parallel.microbatches": 2,
               "pipeline_parallel.schedule": "zbv", "pipeline_parallel.split_method": "uniform",
               "pipeline_parallel.virtual_stages": 2},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 8, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 616, "data_seed": 581}),
    # Silent: a vescale.deferred_init model under DDP was materialised after DDP had
    # registered its gradient hooks, which torch.utils.swap_tensors left behind; no
    # gradient was averaged (and DDP's buckets sat on the meta device).
    ("deferred model under DDP",
     {"model": {"kind": "gpt", "width": 32, "heads": 4, "vocab": 70, "layers": 2, "bias": True, "deferred": True},
      "plan": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 0},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 237, "data_seed": 88}),
    # Exception: the same buckets on meta under a pipeline, which reduces after its schedule.
    ("deferred model under DP x PP",
     {"model": {"kind": "hf_gpt2", "width": 32, "heads": 4, "vocab": 70, "layers": 2, "deferred": True},
      "plan": {"mesh": {"DP": 2, "PP": 2}, "data_parallel.zero_stage": 0, "pipeline_parallel.microbatches": 2,
               "pipeline_parallel.schedule": "1f1b", "pipeline_parallel.split_method": "uniform",
               "pipeline_parallel.virtual_stages": 1},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 237, "data_seed": 88}),
    # Crash (gloo: "Received data size doesn't match"): DDP cut its buckets by local
    # sizes, which differ across tensor-parallel ranks with uneven (here empty) shards,
    # so a bucket's tensor-parallel sums held other parameters on each rank.
    ("DDP buckets over uneven tensor-parallel shards",
     {"model": {"kind": "llama", "width": 12, "heads": 2, "vocab": 64, "layers": 1, "kv_heads": 1},
      "plan": {"mesh": {"DP": 1, "TP": 4}, "data_parallel.zero_stage": 0, "data_parallel.bucket_cap_mb": 0.001,
               "tensor_parallel.sequence_parallel": False},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 1, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 151, "data_seed": 147}),
    # Exception: vescale.parallelize gave the pipeline no sample micro-batch, so the
    # plan's 'flops' and 'time' split methods could never work; and the profile of a
    # Hugging Face model read values on meta (its padding check) and reused the KV
    # cache that its meta run had filled.
    ("split by measured time, Hugging Face GPT-2",
     {"model": {"kind": "hf_gpt2", "width": 24, "heads": 4, "vocab": 70, "layers": 2},
      "plan": {"mesh": {"PP": 2, "TP": 2}, "pipeline_parallel.microbatches": 4, "pipeline_parallel.schedule": "1f1b",
               "pipeline_parallel.split_method": "time", "pipeline_parallel.virtual_stages": 1,
               "tensor_parallel.sequence_parallel": False},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 8, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 491, "data_seed": 922}),
    # Exception: optimizer state loaded for a deferred model's parameters was made on the
    # meta device, as the parameters still were, and the loaded values were dropped.
    ("checkpoint resumed into a deferred model with fused Adam",
     {"model": {"kind": "hf_gpt2", "width": 24, "heads": 4, "vocab": 64, "layers": 2, "deferred": True},
      "plan": {"mesh": {"DP": 2, "PP": 2}, "data_parallel.zero_stage": 0, "pipeline_parallel.microbatches": 2,
               "pipeline_parallel.schedule": "1f1b", "pipeline_parallel.split_method": "uniform",
               "pipeline_parallel.virtual_stages": 1},
      "optimizer": {"kind": "adam_fused"},
      "loop": {"steps": 2, "seq": 8, "batch": 8, "scheduler": None, "eval_after": None,
               "resume": {"after": 1, "plan": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 0}}},
      "init_seed": 558, "data_seed": 604}),
    # Exception ("distribute_tensor got a meta tensor"): bf16 parameters (fp32 masters)
    # for a deferred model; the plan's cast made meta tensors with no recording.
    ("bf16 parameters of a deferred model",
     {"model": {"kind": "hf_llama", "width": 24, "heads": 4, "vocab": 70, "layers": 1, "tied": True, "kv_heads": 2,
                "deferred": True},
      "plan": {"mesh": {"DP": 2, "TP": 2}, "tensor_parallel.sequence_parallel": True, "data_parallel.zero_stage": 3,
               "mixed_precision.param_dtype": "bfloat16"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 2, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 963, "data_seed": 106}),
    # Divergent exceptions (garbage indices): the 'time' split profile timed each unit
    # on an empty copy, whose buffers (BERT's position and token-type ids) held garbage.
    ("split by measured time, BERT",
     {"model": {"kind": "hf_bert", "width": 16, "heads": 4, "vocab": 70, "layers": 2},
      "plan": {"mesh": {"DP": 2, "PP": 2}, "data_parallel.zero_stage": 0, "pipeline_parallel.microbatches": 1,
               "pipeline_parallel.schedule": "1f1b", "pipeline_parallel.split_method": "time",
               "pipeline_parallel.virtual_stages": 1},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 8, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 614, "data_seed": 554}),
    # Hang (an error on one pipeline rank only): ZeRO-3 under ZB-V, where one rank runs
    # the first and the last stage. The last stage's forward emptied the root unit's
    # parameters (embeddings, head), which the first stage's backward then read.
    ("ZeRO-3 with ZB-V, BERT",
     {"model": {"kind": "hf_bert", "width": 8, "heads": 2, "vocab": 64, "layers": 4},
      "plan": {"mesh": {"PP": 2, "DP": 1, "TP": 2}, "tensor_parallel.sequence_parallel": False,
               "data_parallel.zero_stage": 3, "pipeline_parallel.schedule": "zbv",
               "pipeline_parallel.virtual_stages": 2, "pipeline_parallel.microbatches": 4,
               "pipeline_parallel.split_method": "uniform"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 8, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 2, "data_seed": 290}),
    # Wrong (a skipped step): fp16 parameters with dynamic loss scaling, DP4. DDP summed
    # the ranks' loss-scaled fp16 gradients and divided after: the sum overflowed where
    # the average (one device's gradient) does not, so every rank skipped the step one
    # device takes. It divides before the sum now, as torch's DDP does.
    ("fp16 loss scaling over DP4, ZeRO-3, GPT-2",
     {"model": {"kind": "hf_gpt2", "width": 8, "heads": 2, "vocab": 64, "layers": 1},
      "plan": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 3, "mixed_precision.param_dtype": "float16",
               "mixed_precision.loss_scale": "dynamic"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 207, "data_seed": 252}),
    # Wrong (a skipped step): fp16 loss scaling over DP4, ZeRO-1, a tied Qwen2. Each rank
    # backpropagated 2^16 times the mean of its own 2 sequences, a gradient 4 times one
    # device's (the mean of 8): it overflowed inside the backward on two ranks, and every
    # rank skipped the step one device takes. The loss's gradient is divided by the DP size
    # at the root now, and DDP sums those shares (DDP.mark_shares).
    ("fp16 loss scaling over DP4, local-mean gradients, Qwen2",
     {"model": {"kind": "hf_qwen2", "width": 8, "heads": 2, "kv_heads": 2, "vocab": 64, "layers": 1, "tied": True},
      "plan": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 1, "mixed_precision.param_dtype": "float16",
               "mixed_precision.loss_scale": "dynamic"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 8, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 49, "data_seed": 790}),
    # Wrong (a step taken), with that fix's first version: the ranks stepped where one
    # device skips. An fp16 loss's gradient at the scale 2^16 is inf (fp16 ends at 65,504),
    # so one device skips its first step; the ranks' 2^16 / 4 was finite. The root now
    # multiplies by the scale first, in the loss's dtype, and divides by the DP size after.
    ("fp16 loss scaling over DP4, the root gradient's own overflow, BERT",
     {"model": {"kind": "hf_bert", "width": 8, "heads": 2, "vocab": 70, "layers": 1},
      "plan": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 1, "mixed_precision.param_dtype": "float16",
               "mixed_precision.loss_scale": "dynamic"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 8, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 293, "data_seed": 428}),
    # Ranks that disagree (found once the fuzzer compared the ranks' losses bit for bit):
    # DP2 x TP2, fp32. The loss returned was this rank's loss + (mean - mine); with a loss
    # Partial over TP that sum rounds once per TP rank, and the two DP rows reported losses
    # an ulp apart. The loss's value is now the mean itself (the same bits on every rank).
    ("the global loss is the same bits on every rank, DP2 x TP2, Llama",
     {"model": {"kind": "llama", "width": 8, "heads": 2, "kv_heads": 2, "vocab": 48, "layers": 4},
      "plan": {"mesh": {"DP": 2, "TP": 2}, "data_parallel.zero_stage": 0, "tensor_parallel.sequence_parallel": False},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 2, "seq": 12, "batch": 4, "scheduler": None, "eval_after": None, "resume": None,
               "data": {"epoch_batches": 2, "seed": 60, "shuffle": True}},
      "init_seed": 766, "data_seed": 391}),
    # Hang (seed 29253, the first draws of what differs between ranks): a deferred Qwen2
    # resumed under DP2 x PP2, whose next batch (1 row) the pipeline refuses before any
    # forward; the export then gathered from a model never materialised ("Cannot copy out
    # of meta tensor" on one stage's ranks, the other stage waiting). Saving and exporting
    # now materialise a deferred model first, as its first forward would.
    ("export of a deferred pipeline model before its first forward, Qwen2",
     {"model": {"kind": "hf_qwen2", "width": 16, "heads": 4, "vocab": 48, "layers": 4, "tied": False, "kv_heads": 1,
                "deferred": True},
      "plan": {"mesh": {"TP": 4}, "tensor_parallel.sequence_parallel": False},
      "optimizer": {"kind": "sgd_momentum"},
      "loop": {"steps": 2, "seq": 12, "batch": 2, "scheduler": "lambda", "eval_after": 0,
               "resume": {"after": 1, "plan": {"mesh": {"DP": 2, "PP": 2}, "data_parallel.zero_stage": 0,
                                               "pipeline_parallel.schedule": "1f1b",
                                               "pipeline_parallel.microbatches": 1}},
               "data": {"shuffle": True, "seed": 19, "epoch_batches": 2}, "last": 1},
      "init_seed": 72, "data_seed": 851}),
    # Wrong (a step skipped that one device takes; seeds 29525, 130434, 130858, shrunk):
    # fp16 with dynamic loss scaling, a last batch of 1 row over DP4. The rank holding it
    # weighs 4 times an even share, and that weight multiplied the loss's gradient before
    # the scale (2^15) did and the DP share divided it: 2^17, past fp16's range. The weight
    # now sits innermost: scale first, then the share, then the weight.
    ("fp16 loss scaling with a last batch of fewer rows than DP ranks, GPT",
     {"model": {"kind": "gpt", "width": 24, "heads": 4, "vocab": 70, "layers": 1, "bias": False},
      "plan": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 2, "mixed_precision.param_dtype": "float16",
               "mixed_precision.loss_scale": "dynamic"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 2, "seq": 8, "batch": 4, "last": 1, "scheduler": None, "eval_after": None, "resume": None,
               "data": {"epoch_batches": 2, "seed": 0, "shuffle": False}},
      "init_seed": 101, "data_seed": 759}),
    # Wrong (seeds 140003, 140055): masked prompts, a micro-batch without a target. The
    # pipeline's predict joined the micro-batches' losses by their rows: NaN where one
    # device's loss over the batch is finite (off by ~1e-3 without an empty micro-batch).
    ("predict through a pipeline over masked prompts",
     {"model": {"kind": "hf_qwen2", "width": 24, "heads": 4, "vocab": 48, "layers": 2, "tied": False, "kv_heads": 2},
      "plan": {"mesh": {"PP": 2, "DP": 2}, "data_parallel.zero_stage": 0, "pipeline_parallel.schedule": "1f1b",
               "pipeline_parallel.virtual_stages": 1, "pipeline_parallel.microbatches": 4,
               "pipeline_parallel.split_method": "uniform"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 12, "batch": 8, "scheduler": None, "eval_after": 0, "resume": None, "prompts": True},
      "init_seed": 770, "data_seed": 776}),
    # Wrong (seed 140050): a pipeline with ZeRO-3 weighed its micro-batches by rows, and a
    # micro-batch of BERT's whose targets were all masked gave NaN losses and gradients.
    ("a pipeline with ZeRO-3 over masked targets",
     {"model": {"kind": "hf_bert", "width": 24, "heads": 4, "vocab": 70, "layers": 2},
      "plan": {"mesh": {"DP": 2, "PP": 2}, "data_parallel.zero_stage": 3, "pipeline_parallel.schedule": "1f1b",
               "pipeline_parallel.virtual_stages": 1, "pipeline_parallel.microbatches": 2,
               "pipeline_parallel.split_method": "uniform"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 1, "seq": 8, "batch": 4, "scheduler": None, "eval_after": None, "resume": None,
               "prompts": True},
      "init_seed": 977, "data_seed": 578}),
    # Exception (seed 152042): an optimizer over the blocks only, whose one block is frozen,
    # holds empty groups, which torch takes; vescale's optimizer passed torch a flat, empty
    # list ("optimizer got an empty parameter list").
    ("an optimizer whose groups are empty",
     {"model": {"kind": "gpt", "bias": False, "frozen": "first_block", "width": 16, "heads": 4, "vocab": 48,
                "layers": 1},
      "plan": {"mesh": {"DP": 4, "PP": 1}, "data_parallel.zero_stage": 0},
      "optimizer": {"kind": "adamw_groups", "only": r"transformer\.h"},
      "loop": {"steps": 1, "seq": 12, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 226, "data_seed": 340}),
    # Wrong (seed 156317): resumed from a checkpoint into a deferred_init model (meta until
    # its first step), the loop's edit inside full_parameters() ran on meta tensors and was
    # dropped when they were materialised; full_parameters() now materialises first.
    ("an edit of a deferred model resumed under another pipeline",
     {"model": {"kind": "llama", "width": 16, "heads": 2, "vocab": 64, "layers": 4, "kv_heads": 2, "deferred": True},
      "plan": {"mesh": {"DP": 2, "PP": 2}, "data_parallel.zero_stage": 0, "pipeline_parallel.schedule": "1f1b",
               "pipeline_parallel.virtual_stages": 1, "pipeline_parallel.microbatches": 1,
               "pipeline_parallel.split_method": "uniform"},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 2, "seq": 8, "batch": 2, "scheduler": None, "eval_after": None,
               "resume": {"after": 1, "plan": {"mesh": {"PP": 4}, "pipeline_parallel.schedule": "zb_h1",
                                               "pipeline_parallel.microbatches": 2}},
               "edit": {"before_step": 1}},
      "init_seed": 510, "data_seed": 165}),
    # Crash (seed 157386): DDP queued the end of its backward from the first gradient, into
    # the graph task running then; on the ranks that skipped the branch at the head (the
    # norms frozen) that was reentrant checkpointing's nested backward, which ended early,
    # and the ranks issued different collectives. Backward reaching the output queues it now.
    ("a branch at the head over a reentrant-checkpointed block",
     {"model": {"kind": "gpt", "width": 32, "heads": 4, "vocab": 70, "layers": 1, "bias": True,
                "checkpointing": "reentrant", "branch": {"at": "head", "every": 3}, "frozen": "norms"},
      "plan": {"mesh": {"DP": 2, "TP": 2}, "tensor_parallel.sequence_parallel": False,
               "data_parallel.zero_stage": 0, "gradient.clip_norm": 0.05},
      "optimizer": {"kind": "sgd"},
      "loop": {"steps": 3, "seq": 8, "batch": 4, "scheduler": None, "eval_after": None, "resume": None},
      "init_seed": 767, "data_seed": 973}),
]


def test_setups_that_found_bugs():
    verdicts = run_literals([setup for _, setup in REGRESSIONS])
    failures = [f"{what}: {kind}: {detail}" for (what, _), (kind, detail) in zip(REGRESSIONS, verdicts)
                if kind != "ok"]
    assert failures == []


def _campaign_is_clean(count: int, seed: int, world: int = 4) -> None:
    result = campaign(count, seed, log=lambda *a: None, world=world)
    findings = "\n\n".join(f"seed {f['seed']}: {f['kind']}: {f['detail']}\nliteral: {f['setup']}"
                           for f in result["findings"])
    assert result["counts"].get("ok", 0) == count, f"{result['counts']}\n\n{findings}"


def test_random_setups_match_single_device():
    _campaign_is_clean(int(os.environ.get("VESCALE_FUZZ_SETUPS", "30")),
                       int(os.environ.get("VESCALE_FUZZ_SETUP_SEED", "9000000")))


def test_random_setups_on_three_ranks_match_single_device():
    """Odd meshes (DP3, TP3, PP3): every shard of an even width is uneven."""
    _campaign_is_clean(int(os.environ.get("VESCALE_FUZZ_SETUPS_3", "10")), 9100000, world=3)
