"""The decode-attention roofline: where the rotation of rotated keys runs, and what it costs."""

from __future__ import annotations

from infer8.attention.decode_roofline import decode_cost

# batch 512 x 8 KV heads x 32 splits, group 4 (BLOCK_G 16), head_dim 128, 4K contexts, FP8
SHAPE = dict(num_seqs=512, num_heads=32, num_kv_heads=8, head_dim=128, context_tokens=4096,
             num_splits=32, kv_bytes_per_element=1, scale_bytes_per_token=2)  # fmt: skip


def test_rotating_in_every_split_program_outweighs_the_kv_read() -> None:
    before = decode_cost(**SHAPE, rotated=True, rotate_in_splits=True)
    after = decode_cost(**SHAPE, rotated=True)
    plain = decode_cost(**SHAPE)
    # two [16, 128] x [128, 128] products in each of 512 * 8 * 32 programs
    assert before.rotation_flops == 2 * (512 * 8 * 32) * 2 * 16 * 128 * 128 > 100e9
    # one rotation of q and one of the output per token and query head
    assert after.rotation_flops == 2 * 2 * (512 * 32) * 128 * 128
    assert before.rotation_flops == 128 * after.rotation_flops  # 32 splits x 16 rows / 4 heads
    # the KV read is the same (4.3 GB); the rotation's extra bytes are now a small share
    assert before.kv_bytes == after.kv_bytes == 2 * 512 * 4096 * 8 * (128 + 2)
    assert after.attention_flops == plain.attention_flops == 4 * 512 * 8 * 16 * 4096 * 128
    assert after.rotation_flops < 0.01 * after.attention_flops
    assert before.rotation_flops >= before.attention_flops  # as much as attention itself
    # q read and written once in bf16 (no float32 output round trip), the matrix read by each
    # of the 512 x 2 programs of the q rotation and of the reduce (16 heads each)
    extra = 2 * 512 * 32 * 128 * 2 + 2 * (512 * 2) * 128 * 128 * 4
    assert after.num_bytes - plain.num_bytes == extra < 0.03 * plain.num_bytes


def test_split_rotation_pads_query_heads_to_sixteen_per_program() -> None:
    # 12 query heads: each program's dot still multiplies 16 rows
    shape = {**SHAPE, "num_heads": 12, "num_kv_heads": 4}
    cost = decode_cost(**shape, rotated=True)
    assert cost.rotation_flops == 2 * 2 * (512 * 16) * 128 * 128


def test_one_split_rotates_outside_too_and_no_rotation_costs_nothing() -> None:
    one = {**SHAPE, "num_splits": 1}
    outside = decode_cost(**one, rotated=True)
    assert outside.rotation_flops == decode_cost(**SHAPE, rotated=True).rotation_flops
    assert decode_cost(**one, rotated=True, rotate_in_splits=True).rotation_flops == (
        2 * (512 * 8) * 2 * 16 * 128 * 128
    )
    assert decode_cost(**one).rotation_flops == 0
    # no split partials with one split; 32 splits write and read 512 * 32 * 32 * 129 floats
    assert decode_cost(**one).other_bytes == 2 * 512 * 32 * 128 * 2
    split = decode_cost(**SHAPE)
    assert split.other_bytes == 2 * 512 * 32 * 128 * 2 + 2 * 512 * 32 * 32 * 129 * 4
    # rotated, or with the exact tail (one more split), one split writes partials as well
    qo = 2 * 512 * 32 * 128 * 2
    rotation = qo + 2 * (512 * 2) * 128 * 128 * 4
    assert outside.other_bytes == qo + 2 * 512 * 32 * 1 * 129 * 4 + rotation
    with_tail = decode_cost(**SHAPE, tail=True)
    assert with_tail.other_bytes == 2 * 512 * 32 * 128 * 2 + 2 * 512 * 32 * 33 * 129 * 4
