"""Tensor parallelism in one process: sharding, parallel layers on thread ranks, launch env, k8s."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

from infer8.config import EngineArgs
from infer8.distributed.parallel_state import TensorParallelGroup, new_group
from infer8.distributed.sharding import TensorParallelShard, check_tensor_parallel_size
from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from
from infer8.executor.launch import LaunchEnv, launched_env
from infer8.layers.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from infer8.models.llama import LlamaArchConfig
from infer8.quant.kv_scales import StaticKVScales

ROOT = Path(__file__).resolve().parents[2]
LWS = ROOT / "deploy" / "k8s" / "examples" / "multinode-lws.yaml"
K8S_VERSION = "1.32"
HEAD_DIM = 4


def arch(
    num_heads: int = 8, num_kv_heads: int = 4, intermediate: int = 16, vocab: int = 10
) -> LlamaArchConfig:
    return LlamaArchConfig.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": num_heads * HEAD_DIM,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
        }
    )


# -- which heads a rank holds -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "world_size"),
    [(8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 1, 2), (8, 1, 8), (4, 4, 1)],
)
def test_every_rank_holds_the_kv_heads_its_query_heads_read(
    num_heads: int, num_kv_heads: int, world_size: int
) -> None:
    cfg = arch(num_heads, num_kv_heads)
    group = num_heads // num_kv_heads  # query head h reads KV head h // group
    all_q: list[int] = []
    for rank in range(world_size):
        shard = TensorParallelShard(cfg, rank, world_size)
        assert {h // group for h in shard.q_heads} <= set(shard.kv_heads)
        view = shard.rank_config()
        assert view.num_attention_heads == num_heads // world_size
        assert view.num_key_value_heads == max(1, num_kv_heads // world_size)
        # the rank's GQA grouping reproduces the model's: local head i reads local KV head i // g
        local_group = view.num_attention_heads // view.num_key_value_heads
        for i, h in enumerate(shard.q_heads):
            assert shard.kv_heads[i // local_group] == h // group
        all_q += list(shard.q_heads)
    assert all_q == list(range(num_heads))


@pytest.mark.parametrize(
    ("cfg", "world_size", "message"),
    [
        (
            arch(num_heads=9, num_kv_heads=3, intermediate=18),
            2,
            r"does not divide the model's 9 attention heads; choose one of \[1, 3, 9\]",
        ),
        (arch(num_heads=12, num_kv_heads=3), 2, r"can neither split the model's 3 KV heads"),
        (arch(num_heads=12, num_kv_heads=4), 6, r"can neither split the model's 4 KV heads"),
        (arch(intermediate=10), 4, r"does not divide the model's intermediate size 10"),
        (arch(), 0, r"must be >= 1"),
    ],
)
def test_splits_that_cannot_work_are_refused_with_the_reason(
    cfg: LlamaArchConfig, world_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_size(cfg, world_size)


# -- slicing a checkpoint ------------------------------------------------------------------------
def _checkpoint(cfg: LlamaArchConfig) -> dict[str, torch.Tensor]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (q, h),
        "model.layers.0.self_attn.q_proj.bias": (q,),
        "model.layers.0.self_attn.k_proj.weight": (kv, h),
        "model.layers.0.self_attn.k_proj.bias": (kv,),
        "model.layers.0.self_attn.v_proj.weight": (kv, h),
        "model.layers.0.self_attn.o_proj.weight": (h, q),
        "model.layers.0.mlp.gate_proj.weight": (i, h),
        "model.layers.0.mlp.up_proj.weight": (i, h),
        "model.layers.0.mlp.down_proj.weight": (h, i),
    }
    return {name: torch.randn(shape) for name, shape in shapes.items()}


# name -> the dim along which the ranks' slices concatenate back (None: replicated)
SPLIT_DIM = {
    "model.embed_tokens.weight": 0,
    "lm_head.weight": 0,
    "model.norm.weight": None,
    "model.layers.0.input_layernorm.weight": None,
    "model.layers.0.self_attn.q_proj.weight": 0,
    "model.layers.0.self_attn.q_proj.bias": 0,
    "model.layers.0.self_attn.k_proj.weight": 0,
    "model.layers.0.self_attn.k_proj.bias": 0,
    "model.layers.0.self_attn.v_proj.weight": 0,
    "model.layers.0.self_attn.o_proj.weight": 1,
    "model.layers.0.mlp.gate_proj.weight": 0,
    "model.layers.0.mlp.up_proj.weight": 0,
    "model.layers.0.mlp.down_proj.weight": 1,
}


def test_the_ranks_slices_put_together_are_the_checkpoint() -> None:
    cfg = arch(num_heads=8, num_kv_heads=4, vocab=12)
    ckpt = _checkpoint(cfg)
    shards = [TensorParallelShard(cfg, rank, 2) for rank in range(2)]
    for name, tensor in ckpt.items():
        parts = [dict(s.shard_weights(iter(ckpt.items())))[name] for s in shards]
        dim = SPLIT_DIM[name]
        if dim is None:
            assert all(p is tensor for p in parts), name
        else:
            assert parts[0].shape[dim] == tensor.shape[dim] // 2, name
            assert torch.equal(torch.cat(parts, dim=dim), tensor), name


def test_vocabulary_rows_are_padded_when_the_ranks_do_not_divide_them() -> None:
    cfg = arch(vocab=10)
    embed = torch.randn(10, cfg.hidden_size)
    parts = [
        TensorParallelShard(cfg, rank, 4).shard_tensor("model.embed_tokens.weight", embed)
        for rank in range(4)
    ]
    assert [p.shape[0] for p in parts] == [3, 3, 3, 3]  # ceil(10 / 4) rows each
    assert torch.equal(torch.cat(parts)[:10], embed)
    assert not parts[3][1:].any()  # the last rank's two padding rows are zero
    assert TensorParallelShard(cfg, 3, 4).vocab_rows == range(9, 10)


def test_replicated_kv_heads_give_each_rank_its_query_heads_kv_head() -> None:
    cfg = arch(num_heads=8, num_kv_heads=2)
    k = _checkpoint(cfg)["model.layers.0.self_attn.k_proj.weight"]  # [2 * HEAD_DIM, hidden]
    for rank, head in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        part = TensorParallelShard(cfg, rank, 4).shard_tensor(
            "model.layers.0.self_attn.k_proj.weight", k
        )
        assert torch.equal(part, k[head * HEAD_DIM : (head + 1) * HEAD_DIM])


def test_fp8_kv_scales_follow_the_ranks_kv_heads() -> None:
    cfg = arch(num_heads=8, num_kv_heads=4)
    shard = TensorParallelShard(cfg, 1, 2)  # KV heads 2 and 3
    per_layer, per_head = torch.tensor(0.5), torch.arange(4.0)
    per_channel = torch.arange(4.0 * HEAD_DIM)
    name = "model.layers.0.self_attn.k_scale"
    assert torch.equal(shard.shard_tensor(name, per_layer), per_layer)
    assert torch.equal(shard.shard_tensor(name, per_head), torch.tensor([2.0, 3.0]))
    assert torch.equal(shard.shard_tensor(name, per_channel), per_channel[2 * HEAD_DIM :])
    static = StaticKVScales(
        [per_head.view(4, 1), torch.ones(1, 1)], [per_channel.view(4, HEAD_DIM)] * 2, "file"
    )
    cut = shard.shard_static_scales(static)
    assert torch.equal(cut.k[0], torch.tensor([[2.0], [3.0]])) and cut.k[1].shape == (1, 1)
    assert torch.equal(cut.v[0], per_channel.view(4, HEAD_DIM)[2:])


# -- options and the launcher's environment ------------------------------------------------------
def test_tensor_parallel_size_is_an_engine_flag_validated_with_the_others() -> None:
    ns = make_serve_parser().parse_args(["/models/m", "--tensor-parallel-size", "4"])
    assert serve_args_from(ns)[0].tensor_parallel_size == 4
    with pytest.raises(SystemExit):
        make_serve_parser().parse_args(["/models/m", "--tensor-parallel-size", "0"])
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineArgs(tensor_parallel_size=0).create_configs("m")


def test_launch_env_is_read_from_torchrun_variables() -> None:
    assert LaunchEnv.from_environ({}) is None
    assert LaunchEnv.from_environ({"WORLD_SIZE": "1", "RANK": "0"}) is None
    environ = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "leader.infer8",
        "MASTER_PORT": "29500",
    }
    assert launched_env(4, environ) == LaunchEnv(3, 4, 1, "leader.infer8", 29500)
    with pytest.raises(ValueError, match="--tensor-parallel-size is 2"):
        launched_env(2, environ)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="outside"):
        LaunchEnv.from_environ({**environ, "RANK": "4"})


# -- the multi-node Kubernetes example -----------------------------------------------------------
def _lws() -> tuple[dict[str, Any], dict[str, Any]]:
    lws, service = yaml.safe_load_all(LWS.read_text())
    assert (lws["kind"], service["kind"]) == ("LeaderWorkerSet", "Service")
    return lws, service


def _serve_argv(container: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Split `tini -- torchrun ... --no-python infer8 serve ARGS` into torchrun's and serve's."""
    argv = container["command"] + container["args"]
    assert argv[:3] == ["tini", "--", "torchrun"]
    start = argv.index("--no-python")
    assert argv[start + 1 : start + 3] == ["infer8", "serve"]
    return argv[3:start], argv[start + 3 :]


def test_multinode_example_pods_validate_against_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    lws, service = _lws()
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    template = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        # the LeaderWorkerSet is a CRD; its pod templates are core PodTemplateSpecs
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"infer8-tp-{role}"},
            "template": template[role],
        }
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_multinode_example_launches_one_rank_per_gpu_of_the_group() -> None:
    lws, service = _lws()
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    group_size = template["size"]
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = template[role]["spec"]["containers"]
        torchrun_args, serve_argv = _serve_argv(container)
        engine_args, server_config = serve_args_from(make_serve_parser().parse_args(serve_argv))
        flags = dict(a.removeprefix("--").split("=", 1) for a in torchrun_args)
        num_gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert int(flags["nproc-per-node"]) == num_gpus
        assert engine_args.tensor_parallel_size == group_size * num_gpus
        assert flags["nnodes"] == "$(LWS_GROUP_SIZE)"
        assert flags["node-rank"] == "$(LWS_WORKER_INDEX)"
        assert flags["master-addr"] == "$(LWS_LEADER_ADDRESS)"
        assert engine_args.device == "cuda"
    leader = template["leaderTemplate"]
    (container,) = leader["spec"]["containers"]
    assert service["spec"]["selector"].items() <= leader["metadata"]["labels"].items()
    worker_labels = template["workerTemplate"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker_labels.items()
    http = next(p for p in container["ports"] if p["name"] == "http")
    assert http["containerPort"] == server_config.port
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # the workers outlive the leader's drain, so in-flight requests can finish
    drain_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain_s += server_config.shutdown_grace_period_s
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    assert worker["lifecycle"]["preStop"]["sleep"]["seconds"] >= drain_s
    assert "ports" not in worker and "livenessProbe" not in worker


# -- the communicating layers, 3 ranks as threads of this process --------------------------------
def _run_ranks(world_size: int, fn: Callable[[TensorParallelGroup], Any]) -> list[Any]:
    """Run fn(group) on every rank of a gloo group whose ranks are threads; return the results."""
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = new_group(store, rank, world_size, torch.device("cpu"), lambda: None, 10.0)
            results[rank] = fn(group)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def test_parallel_layers_compute_what_the_unsplit_layers_compute() -> None:
    vocab, hidden, inner, world = 10, 6, 9, 3  # vocab 10 over 3 ranks: 4 rows each, 2 padding
    torch.manual_seed(0)
    embed, head = torch.randn(vocab, hidden), torch.randn(vocab, hidden)
    down = torch.randn(hidden, inner)
    ids, x, h = torch.tensor([0, 3, 4, 9, 7]), torch.randn(5, inner), torch.randn(5, hidden)

    def on_rank(group: TensorParallelGroup) -> tuple[torch.Tensor, ...]:
        cfg = arch(num_heads=3, num_kv_heads=3, intermediate=inner, vocab=vocab)
        shard = TensorParallelShard(cfg, group.rank, world)
        cols = slice(shard.intermediate.start, shard.intermediate.stop)
        row_linear = RowParallelLinear(inner // world, hidden, group)
        row_linear.weight.data = down[:, cols].clone()
        embedding = VocabParallelEmbedding(vocab, hidden, group)
        embedding.weight.data = shard.shard_tensor("model.embed_tokens.weight", embed)
        lm_head = ParallelLMHead(hidden, vocab, group)
        lm_head.weight.data = shard.shard_tensor("lm_head.weight", head)
        with torch.no_grad():
            return row_linear(x[:, cols].clone()), embedding(ids), lm_head(h)

    for out, emb, logits in _run_ranks(world, on_rank):
        torch.testing.assert_close(out, x @ down.T)
        assert torch.equal(emb, embed[ids])  # exactly one rank contributes each row
        assert logits.shape == (5, vocab)  # padding rows cut off
        torch.testing.assert_close(logits, h @ head.T)
