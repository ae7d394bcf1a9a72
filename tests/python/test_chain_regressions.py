"""Every finding of the chain fuzzer (tests/fuzz), shrunk, kept as a program that must now
match plain torch: values after every step, then the inputs' gradients, in float64 on
4 ranks (1-d mesh of 4 and 2x2). Each was a wrong result, a hang or an exception on a
program plain torch runs; docs/fuzzing.md tells what each one was."""

from __future__ import annotations

import pytest

from tests.fuzz import rank as fuzz_rank
from tests.fuzz.chains import Program

FINDINGS = {
    # (a) matmul of a 1-d input ends in squeeze_, which left the global shape (1, n)
    "matmul_1d_input": ["1d4", [[[7], 11, ["R"], True]], [["matmul", [0], {"fresh": True, "n": 5, "seed": 3}]]],
    # (b) transpose_ kept the old global shape
    "transpose_inplace_on_shard": ["1d4", [[[4, 1], 5, ["S0"], True]],
                                   [["clone", [0], {}], ["transpose_", [1], {"d0": 1, "d1": 0}],
                                    ["sum", [1], {"dim": 1, "keepdim": False}]]],
    "unsqueeze_inplace": ["2d", [[[3, 1], 416448, ["S0", "R"], True]],
                          [["add", [0, 0], {}], ["unsqueeze_", [1], {"dim": 2}], ["softmax", [1], {"dim": 0}]]],
    "squeeze_inplace_sharded_unit_dim": ["1d4", [[[1, 6], 7, ["S0"], True]],
                                         [["exp", [0], {}], ["squeeze_", [1], {"dim": 0}], ["cumsum", [1], {"dim": 0}]]],
    # (c) amin/amax of a Partial: backward's `self == result` saw a second reduction
    # rounded differently (NaN gradients)
    "amin_of_partial": ["1d4", [[[6, 6, 3], 3, ["P.sum"], True]], [["amin", [0], {"dim": 0, "keepdim": False}]]],
    "amax_of_partial": ["1d4", [[[6, 6, 3], 3, ["P.sum"], True]], [["amax", [0], {"dim": 0, "keepdim": False}]]],
    # writes into a view that had to be taken from a copy of a tensor the user laid out
    "setitem_on_user_shard": ["1d4", [[[5], 459491, ["S0"], False]],
                              [["setitem", [0], {"dim": 0, "start": 3, "length": 2, "s": 0.0}]]],
    "masked_fill_on_view_of_user_shard": ["1d4", [[[1, 1], 897632, ["S0"], False]],
                                          [["view", [0], {"shape": [1, 1, 1]}], ["masked_fill_", [1], {}]]],
    "setitem_after_alias": ["2d", [[[7], 6392, ["R", "S0"], True]],
                            [["maximum", [0, 0], {}], ["zero_", [1], {}], ["squeeze", [1], {}],
                             ["setitem", [2], {"dim": 0, "start": 6, "length": 1, "s": 1.0}]]],
    # a write through one view refreshed a copy taken from the base using the view's data
    "copy_refreshed_from_its_own_base": ["2d", [[[3, 3, 7], 5, ["R", "S0"], False]],
                                         [["view_flat", [0], {}],
                                          ["setitem", [0], {"dim": 1, "start": 2, "length": 1, "s": -2.5}]]],
    # to_local's gradient of a Partial counted once per rank
    "local_round_trip_of_partial_view": ["2d", [[[4, 5, 4], 1, ["R", "P.sum"], True]],
                                         [["split", [0], {"dim": 1}], ["local_round_trip", [1], {"seed": 133297}]]],
    # a kept reduction (see "amin_of_partial") survived a write through another view of
    # the same shard storage; found in the mechanism's first version
    "kept_reduction_dropped_on_alias_write": ["1d4", [[[9, 1], 291022, ["P.max"], False]],
                                              [["local_round_trip", [0], {"seed": 695358}], ["tanh", [0], {}],
                                               ["squeeze_dim", [0], {"dim": 1}], ["squeeze_dim", [2], {"dim": 1}],
                                               ["softmax", [1], {"dim": -1}], ["addcmul_", [3, 3], {}]]],
    # the long campaign's two findings: as_strided (CopySlices in backward) of an empty
    # tensor laid out differently; a base restrided in place after a copy was taken of it
    "as_strided_of_empty_tensor": ["1d4", [[[4, 1, 0, 5], 69099, ["R"], True]],
                                   [["expand", [0], {"lead": 2}], ["redistribute", [1], {"seed": 829607}],
                                    ["setitem", [2], {"dim": 0, "start": 1, "length": 0, "s": 1.0}]]],
    "copy_follows_a_base_restrided_in_place": ["2d", [[[3, 2, 1, 8], 569095, ["S2", "R"], False]],
                                               [["reshape", [0], {"shape": [3, 2, 1, 4, 2]}],
                                                ["transpose_", [0], {"d0": 3, "d1": 1}], ["mul_", [2, 2], {}]]],
    # an empty view's meta shadow had a negative storage span
    "setitem_empty_view": ["1d4", [[[4, 3, 1], 244362, ["S2"], False]],
                           [["setitem", [0], {"dim": 2, "start": 0, "length": 0, "s": 1.0}]]],
    "setitem_empty_rows": ["2d", [[[3, 9, 6], 929764, ["S0", "R"], False]],
                           [["setitem", [0], {"dim": 0, "start": 1, "length": 0, "s": 0.0}]]],
    # autograd's CopySlices writes into as_strided of a fresh no-grad result
    "setitem_backward": ["2d", [[[4, 3, 2], 5, ["S1", "P.sum"], True]],
                         [["min_dim", [0], {"dim": 2, "keepdim": False}], ["pow", [1], {}],
                          ["setitem", [2], {"dim": 1, "start": 2, "length": 1, "s": 1.0}]]],
    # lists of views (unbind/split) were not treated as views: a write missed the base
    "write_into_unbind_of_cast_partial_max": ["2d", [[[9, 3], 256108, ["P.max", "R"], True]],
                                              [["float_to_int_to_float", [0], {}], ["unbind", [1], {"dim": -2}],
                                               ["mul_scalar_", [2], {"s": -2.0}]]],
    "write_into_one_of_two_overlapping_copies": ["1d4", [[[5, 6], 21, ["S0"], False]],
                                                 [["narrow", [0], {"dim": 0, "start": 0, "length": 2}],
                                                  ["narrow", [0], {"dim": 0, "start": 1, "length": 2}],
                                                  ["mul_scalar_", [1], {"s": 3.0}]]],
    # unused unbind outputs get plain 0-d zeros in backward; stack's meta run refused them
    "unbind_backward_partly_used": ["1d4", [[[5], 955040, ["R"], True]], [["unbind", [0], {"dim": 0}]]],
    # softmax over an empty split dim was composed from reductions without identity
    "softmax_over_empty_split_dim": ["1d4", [[[0, 6, 7], 376852, ["S0"], True]], [["softmax", [0], {"dim": -3}]]],
    "softmax_over_empty_dim_2d": ["2d", [[[4, 0, 3, 3], 132343, ["R", "S1"], False]], [["softmax", [0], {"dim": 1}]]],
    # softmax over a split dim, composed from exp / sum, kept a transposed input's layout
    # where torch's kernel returns contiguous: dropout then drew its mask in another order
    "composed_softmax_layout_then_dropout": ["2d", [[[1, 7, 4], 362822, ["R", "S2"], True]],
                                            [["transpose", [0], {"d0": 2, "d1": 1}], ["softmax", [1], {"dim": -2}],
                                             ["dropout", [2], {"p": 0.25, "seed": 261401}]]],
    # an in-place write into a to_local/from_local round trip's result, then a read of its
    # source: the data is shared, the gradient path is not (documented; the fuzzer's
    # reference modelled the round trip as an autograd view and called this wrong)
    "write_into_round_trip_then_read_source": ["2d", [[[5], 102397, ["R", "R"], True]],
                                               [["linear", [0], {"fresh": True, "n": 4, "seed": 745808}],
                                                ["local_round_trip", [1], {"seed": 269699}],
                                                ["mul_scalar_", [2], {"s": 3.0}], ["masked_fill", [1], {}]]],
    # from_local copied a local that was a view into a larger buffer (not densely packed),
    # so a write into the round trip's result never reached the source
    "round_trip_of_a_view_shares_its_data": ["1d4", [[[6, 3, 6, 4], 842560, ["R"], True]],
                                             [["narrow", [0], {"dim": 3, "start": 2, "length": 1}],
                                              ["local_round_trip", [1], {"seed": 96457}], ["masked_fill_", [2], {}]]],
    "round_trip_of_a_view_of_a_shard_shares_its_data": ["2d", [[[6, 3, 6, 4], 842560, ["S2", "S0"], True]],
                                                        [["narrow", [0], {"dim": 3, "start": 1, "length": 2}],
                                                         ["local_round_trip", [1], {"seed": 96457}],
                                                         ["masked_fill_", [2], {}]]],
    # a view of a view of a copy is a copy of a copy: a write into the first base
    # refreshed the first copy only (seed 20002446, then variants)
    "write_into_base_reaches_a_copy_of_a_copy": ["2d", [[[3, 9], 1, ["S0", "S1"], False]],
                                                 [["reshape", [0], {"shape": [3, -1, 3]}],
                                                  ["diagonal", [1], {"d0": 0, "d1": 1, "offset": 0}],
                                                  ["copy_", [0], {"seed": 5, "fresh": True}]]],
    "scaling_the_base_reaches_a_select_of_a_copy": ["2d", [[[3, 9], 1, ["S0", "S1"], False]],
                                                    [["reshape", [0], {"shape": [3, -1, 3]}],
                                                     ["select", [1], {"dim": 0, "index": 1}],
                                                     ["mul_scalar_", [0], {"s": 3.0}]]],
    # a round trip of a view taken from a copy shares the copy's data but not its record,
    # so a write into it never reached the base (seed 26000215, then variants)
    "write_into_round_trip_of_a_copy_reaches_the_base": ["2d", [[[5], 1, ["S0", "R"], True]],
                                                         [["narrow", [0], {"dim": 0, "start": 2, "length": 2}],
                                                          ["local_round_trip", [1], {"seed": 3}], ["neg_", [2], {}]]],
    "write_into_two_round_trips_of_a_copy": ["1d4", [[[8], 1, ["S0"], False]],
                                             [["narrow", [0], {"dim": 0, "start": 2, "length": 4}],
                                              ["local_round_trip", [1], {"seed": 3}],
                                              ["local_round_trip", [2], {"seed": 4}],
                                              ["mul_scalar_", [3], {"s": 3.0}], ["mul_scalar_", [0], {"s": 2.0}],
                                              ["add", [3, 1], {}]]],
    # max_pool1d's body reads the data pointer of a CPU tensor without grad (seed 22000865)
    "max_pool1d_without_grad": ["1d4", [[[2, 3, 9], 1, ["S2"], False]],
                                [["max_pool1d", [0], {"k": 2, "stride": 1}]]],
    # ... and without grad torch's own kernel returns a contiguous result, where the route
    # above kept the input's layout: draws in memory order after it differed (seed 29000552)
    "max_pool1d_without_grad_is_contiguous": ["1d4", [[[1, 3, 9], 1, ["R"], False]],
                                              [["transpose", [0], {"d0": 1, "d1": 2}],
                                               ["max_pool1d", [1], {"k": 1, "stride": 1}],
                                               ["randn_like", [2], {"seed": 5}]]],
    "max_pool1d_of_a_shard_then_dropout": ["2d", [[[2, 3, 9], 1, ["S0", "S2"], False]],
                                           [["transpose", [0], {"d0": 1, "d1": 2}],
                                            ["max_pool1d", [1], {"k": 2, "stride": 1}],
                                            ["dropout", [2], {"p": 0.25, "seed": 7}]]],
    # torch's meta kernel of logaddexp lays out a broadcast of an expanded and a transposed
    # value contiguous, its CPU kernel does not: the DTensor's strides (from the meta
    # kernel) misled the dropout after it (seed 32000174)
    "logaddexp_layout_then_dropout": ["1d4", [[[3, 1, 6, 3], 1, ["R"], False]],
                                      [["expand", [0], {"lead": 2}], ["transpose", [0], {"d0": 1, "d1": 3}],
                                       ["logaddexp", [1, 2], {}], ["dropout", [3], {"p": 0.25, "seed": 7}]]],
    # smooth_l1_loss's backward: the meta kernel keeps the input's (transposed) layout, the
    # CPU kernel's gradient is contiguous; linear's backward then could not view it
    # (an exception on a program plain torch runs; seed 40000693, on a 2x3 mesh)
    "loss_backward_layout_then_linear_backward": ["1d4", [[[8, 2, 3, 5], 28824, ["R"], True]],
                                                  [["linear", [0], {"fresh": True, "n": 5, "seed": 638842}],
                                                   ["transpose_", [1], {"d0": 1, "d1": 3}],
                                                   ["smooth_l1", [2], {"fresh": True, "seed": 316182}]]],
    # writing nothing (an empty slice) into an expanded tensor pushed the whole copy back
    # into the expanded base: an error on the ranks with a non-empty shard, a hang on the
    # rank without (seed 34001599)
    "empty_write_into_expanded_tensor": ["1d4", [[[4, 5], 1, ["S1"], False]],
                                         [["expand", [0], {"lead": 2}],
                                          ["setitem", [1], {"dim": 2, "start": 0, "length": 0, "s": 1.0}]]],
    # redistribute of an expanded tensor kept the stride-0 strides in the result's spec,
    # though the result is a new, dense tensor (seeds 34002726, 37003454)
    "redistribute_of_expanded_is_dense": ["1d4", [[[7, 1, 12, 1], 1, ["R"], True]],
                                          [["expand", [0], {"lead": 3}], ["redistribute", [1], {"seed": 360920}]],
                                          "inference"],
    "redistribute_of_expanded_is_dense_2d": ["2d", [[[1, 5, 4], 1, ["R", "R"], True]],
                                             [["expand", [0], {"lead": 3}], ["redistribute", [1], {"seed": 551073}],
                                              ["dropout", [2], {"p": 0.25, "seed": 7}]]],
    # in inference mode, a view op through the replicate fallback made an inference
    # tensor of a normal tensor's view, and autograd's view tracking failed (seed 25001343)
    "unfold_in_inference_mode": ["1d4", [[[1, 9], 1, ["R"], True]],
                                 [["unfold", [0], {"dim": 1, "size": 2, "step": 2}]], "inference"],
    "views_and_writes_in_inference_mode": ["2d", [[[4, 6], 3, ["S1", "S0"], False]],
                                           [["transpose", [0], {"d0": 0, "d1": 1}],
                                            ["narrow", [1], {"dim": 0, "start": 1, "length": 3}],
                                            ["mul_scalar_", [2], {"s": 3.0}]], "inference"],
    # found by the training mode (an optimizer step between two rounds): from_local of a
    # step slice's shard copied it (its dim-order check overrated the slice's extent), so
    # the round trip stopped following the input the optimizer updated (seed 43001519)
    "round_trip_of_step_slice_follows_optimizer": ["1d4", [[[4, 1, 5], 7, ["R"], True]],
                                                   [["step_slice", [0], {"dim": 2}],
                                                    ["local_round_trip", [1], {"seed": 232738}]],
                                                   "train.sgd_foreach.keep"],
    # from_local of an expanded shard (stride 0) copied it into a dense tensor, so the
    # round trip stopped following the input AdamW updated (seed 50002134)
    "round_trip_of_expanded_follows_optimizer": ["2d", [[[1, 6], 7, ["R", "R"], True]],
                                                 [["expand", [0], {"lead": 3}],
                                                  ["local_round_trip", [1], {"seed": 5}]],
                                                 "train.adamw_foreach.zero"],
    # unfold had no rule: the replicate fallback gathered an expanded input densely, and
    # the result's strides lost the expanded dims' zeros (seed 46004298)
    "unfold_of_expanded_keeps_its_strides": ["2d", [[[8, 4, 9], 1, ["R", "S2"], True]],
                                             [["expand", [0], {"lead": 2}],
                                              ["unfold", [1], {"dim": 0, "size": 1, "step": 1}]]],
    # vescale.load into a Partial max target went into a reduced copy (`detach()` of a
    # Partial max made a new tensor; seed 47000066); vescale.save of a Partial saved one
    # rank's addend, and a load into a Partial sum wrote the value into every addend
    # (seed 47000041)
    "checkpoint_into_partial_target": ["2d", [[[3, 1], 945846, ["R", "R"], True]],
                                       [["checkpoint_reshard", [0], {"seed": 203681}]]],
    "checkpoint_of_partial_source": ["2d", [[[7, 2, 6], 312557, ["P.sum", "R"], True]],
                                     [["checkpoint_reshard", [0], {"seed": 431633}]]],
    # double backward (a gradient penalty) of a Partial leaf: the leaf's hook moved its
    # gradient to Replicate outside autograd, so the first gradient had no graph and the
    # second missed every term through it (seeds 55000834, 56000072, 55001934)
    "double_backward_of_partial_sum": ["2d", [[[3, 4], 528709, ["P.sum", "R"], True]], [["grad_penalty", [0], {}]]],
    "double_backward_of_partial_max": ["1d4", [[[4, 4, 3], 919270, ["P.max"], True]], [["grad_penalty", [0], {}]]],
    "double_backward_training": ["2d", [[[6], 1005586, ["P.sum", "R"], True]], [["grad_penalty", [0], {}]],
                                 "train.adam_fused.keep"],
    # a Partial value saved (its detach() reduced by redistribute) and compared with what
    # was loaded: the comparison reduced it along another route, whose last bits differ,
    # so `x > loaded` was True where one device has a tie and the gradient went through
    # the other branch (seed 68000670)
    "partial_reduced_by_save_and_by_an_op": ["2d", [[[3], 165060, ["P.sum", "P.sum"], True]],
                                             [["checkpoint_reshard", [0], {"seed": 538098}], ["where", [0, 1], {}]]],
    # the fix's first version: a reduction kept through a temporary `detach()` (the
    # fuzzer reads values so) outlived the optimizer's write, which the registry missed
    # (it held the dead alias) and a view's shard did not count (its own version counter)
    # (training seeds 7800158, 7800024)
    "kept_through_detach_then_step": ["2d", [[[2], 161829, ["R", "P.sum"], True]],
                                      [["local_round_trip", [0], {"seed": 145332}]], "train.adam_fused.none"],
    "kept_through_view_of_copy_then_step": ["2d", [[[4, 2, 2, 6], 203297, ["P.sum", "I0.2"], True]],
                                            [["reshape", [0], {"shape": [2, 2, 2, 2, 6]}]], "train.adamw_foreach.keep"],
    # a hang: linear's internal view of a transposed Partial max value shared its kept
    # reduction only on the ranks whose shard had no dim of one element (the shards'
    # strides were compared), so reading the value later ran a fresh reduction on some
    # ranks and the kept one's moves on others (seed 84000575, 6 ranks; here 2x2)
    "alias_decided_alike_on_uneven_shards": ["2d", [[[3, 3, 9], 134311, ["P.max", "S1"], True]],
                                             [["transpose", [0], {"d0": 1, "d1": 0}],
                                              ["linear", [1], {"fresh": True, "n": 4, "seed": 3423}]]],
    # found by reading the rules (stop 48): a max/min over a dim that leaves some ranks an
    # empty shard filled their block with int64's extreme, which int32, int8 and uint8
    # cannot hold: those ranks raised, the others waited in the all-reduce
    "int32_amin_over_empty_shards": ["2d", [[[1, 5], 7, ["S0", "R"], False]], [["int32_amin", [0], {"dim": 0}]]],
    "int8_amax_over_empty_shards": ["1d4", [[[3, 2], 8, ["S0"], False]], [["int8_amax", [0], {"dim": 0}]]],
    "uint8_min_over_empty_shards": ["2d", [[[2, 1, 3], 9, ["R", "S0"], False]], [["uint8_min_dim", [0], {"dim": 0}]]],
}


def _check(literal) -> tuple:
    if not fuzz_rank._meshes:
        fuzz_rank.setup()
    return fuzz_rank.check(Program.from_literal(literal))


@pytest.mark.parametrize("name", list(FINDINGS))
def test_finding_matches_single_device(pool4, name):
    verdicts = pool4.run(_check, FINDINGS[name])
    assert all(v == verdicts[0] for v in verdicts), f"ranks disagree: {verdicts}"
    kind, detail = verdicts[0]
    assert kind == "ok", f"{Program.from_literal(FINDINGS[name]).describe()}\n{kind}: {detail}"
