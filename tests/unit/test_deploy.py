"""Deployment files: manifests render and validate, and their commands parse with infer8's CLI."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from infer8.cli import build_parser
from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
EXAMPLES = K8S / "examples"
OVERLAYS = ["cpu", "gpu-h100-fp8", "gpu-h200-fp8"]
K8S_VERSION = "1.32"  # preStop `sleep` needs >= 1.30
# The kustomization fields the fallback renderer implements; others must fail loudly.
RENDERER_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}

Manifest = dict[str, Any]


# -- rendering ------------------------------------------------------------------------------
def _merge(base: Any, patch: Any) -> Any:
    """Strategic-merge `patch` into `base` (maps merge, named lists merge by name, null deletes)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = _merge(merged[key], value) if key in merged else value
        return merged
    items = (base or []) + (patch or []) if isinstance(base, list) else []
    if (
        isinstance(patch, list)
        and items
        and all(isinstance(i, dict) and "name" in i for i in items)
    ):
        merged_list = list(base)
        index = {item["name"]: i for i, item in enumerate(merged_list)}
        for item in patch:
            if item["name"] in index:
                merged_list[index[item["name"]]] = _merge(merged_list[index[item["name"]]], item)
            else:
                merged_list.append(item)
        return merged_list
    return patch


def _pod_containers(doc: Manifest) -> list[dict[str, Any]]:
    """Return the containers and init containers of a Deployment's pod template."""
    if doc.get("kind") != "Deployment":
        return []
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def render_fallback(directory: Path) -> list[Manifest]:
    """Render a kustomization with the subset of kustomize these manifests use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - RENDERER_FIELDS
    assert not unknown, f"{directory}: the fallback renderer does not implement {unknown}"
    docs: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += (
            render_fallback(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
        )
    for entry in kustomization.get("patches", []):
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        target = (patch["kind"], patch["metadata"]["name"])
        hits = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == target]
        assert len(hits) == 1, f"patch {entry['path']} matches {len(hits)} resources"
        docs[hits[0]] = _merge(docs[hits[0]], patch)
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in _pod_containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    new_tag = image.get("newTag", tag)
                    container["image"] = image.get("newName", name) + (
                        f":{new_tag}" if new_tag else ""
                    )
    return docs


@cache
def _render_text(overlay: str) -> str:
    """Render an overlay: `kubectl kustomize` when installed, else the fallback, as JSON text."""
    directory = K8S / "overlays" / overlay
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return json.dumps(render_fallback(directory))
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True
    ).stdout
    return json.dumps(list(yaml.safe_load_all(out)))


def render(overlay: str) -> list[Manifest]:
    """Return a fresh copy of an overlay's rendered manifests."""
    return json.loads(_render_text(overlay))


def by_kind(docs: list[Manifest], kind: str) -> Manifest:
    """Return the one manifest of a kind."""
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def server_container(deployment: Manifest) -> dict[str, Any]:
    """Return the serving container."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# -- the Dockerfile -------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """Return (INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def dockerfile_exec_form(instruction: str) -> list[str]:
    """Return the last ENTRYPOINT / CMD, which must be in exec (JSON) form."""
    values = [args for name, args in dockerfile_instructions() if name == instruction]
    assert values, f"the Dockerfile has no {instruction}"
    parsed = json.loads(values[-1])
    assert isinstance(parsed, list), f"{instruction} must be in exec form for signals to arrive"
    return parsed


def without_init(argv: list[str]) -> list[str]:
    """Drop a leading `tini --` (the image's PID 1)."""
    return argv[2:] if argv[:2] == ["tini", "--"] else argv


def container_argv(container: dict[str, Any]) -> list[str]:
    """Return the command line a container runs, resolving the image's ENTRYPOINT and CMD."""
    if "command" in container:
        return without_init(container["command"] + container.get("args", []))
    args = container["args"] if "args" in container else dockerfile_exec_form("CMD")
    return without_init(dockerfile_exec_form("ENTRYPOINT")) + args


def parse_infer8(argv: list[str]) -> argparse.Namespace:
    """Parse an `infer8 ...` command line with infer8's own parsers; fail the test on errors."""
    assert argv[0] == "infer8", f"not an infer8 command: {argv}"
    try:
        if argv[1] == "serve":
            return make_serve_parser().parse_args(argv[2:])
        return build_parser().parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"infer8 rejects {argv}: exit {e.code}")


# -- manifests ------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_kubernetes_schemas(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = render(overlay)
    volume = ["PersistentVolumeClaim"] if overlay == "gpu-h200-fp8" else []
    assert sorted(d["kind"] for d in docs) == sorted(
        ["Deployment", "PodDisruptionBudget", "Service", *volume]
    )
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_catches_a_misspelled_field() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = by_kind(render("cpu"), "Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fallback_renderer_matches_kustomize(overlay: str) -> None:
    def keyed(docs: list[Manifest]) -> dict[tuple[str, str], Manifest]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert keyed(render_fallback(K8S / "overlays" / overlay)) == keyed(render(overlay))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_command_parses_with_infer8(overlay: str) -> None:
    deployment = by_kind(render(overlay), "Deployment")
    for container in _pod_containers(deployment):
        if container["image"].partition(":")[0] != "infer8":
            continue  # a helper image (the H200 overlay's weight download), checked on its own
        argv = container_argv(container)
        ns = parse_infer8(argv)
        if argv[1] == "serve":
            serve_args_from(ns)  # the engine and server values are valid too


def _plan_for(engine_args: Any, device: str) -> Any:
    from infer8 import plan, plan_presets

    inputs = plan.PlanInputs(
        model=plan_presets.load_model_shape("qwen2-72b-instruct"),
        device=plan_presets.DEVICE_PRESETS[device],
        weight_dtype="fp8" if engine_args.quantization == "fp8" else "bf16",
        kv_cache_dtype=engine_args.kv_cache_dtype,
        gpu_memory_utilization=engine_args.gpu_memory_utilization,
        tensor_parallel_size=engine_args.tensor_parallel_size,
        max_num_seqs=engine_args.max_num_seqs,
        max_num_batched_tokens=engine_args.max_num_batched_tokens,
    )
    return plan.plan_capacity(inputs)


def test_seed_overlay_has_the_seed_flags_and_a_shape_that_starts() -> None:
    deployment = by_kind(render("gpu-h100-fp8"), "Deployment")
    container = server_container(deployment)
    engine_args, _ = serve_args_from(parse_infer8(container_argv(container)))
    assert engine_args.kv_cache_dtype == "fp8_e4m3"
    assert engine_args.gpu_memory_utilization == 0.94
    assert engine_args.max_num_seqs == 512
    assert engine_args.max_num_batched_tokens == 16384
    assert engine_args.enforce_eager
    assert engine_args.device == "cuda"
    assert deployment["spec"]["replicas"] == 4
    limits = container["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == engine_args.tensor_parallel_size == 4
    assert container["image"].endswith(":cuda")
    planned = _plan_for(engine_args, "h100-80gb")
    assert planned.fits and planned.max_concurrent_sessions == 26  # as the overlay documents


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tensor_parallel_pods_give_nccl_a_memory_backed_dev_shm(overlay: str) -> None:
    pod = by_kind(render(overlay), "Deployment")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "infer8"]
    args = container.get("args", [])
    tp = (
        int(args[args.index("--tensor-parallel-size") + 1])
        if "--tensor-parallel-size" in args
        else 1
    )
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    if tp > 1:
        assert "/dev/shm" in mounts, overlay
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "/models" in mounts or overlay == "cpu"  # the patch keeps the base's model mount


def test_h200_overlay_fits_and_fills_its_model_volume() -> None:
    docs = render("gpu-h200-fp8")
    deployment = by_kind(docs, "Deployment")
    container = server_container(deployment)
    engine_args, _ = serve_args_from(parse_infer8(container_argv(container)))
    assert engine_args.quantization == "fp8" and engine_args.kv_cache_dtype == "fp8_e4m3"
    assert not engine_args.enforce_eager  # CUDA graphs on
    assert engine_args.tensor_parallel_size == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    planned = _plan_for(engine_args, "h200-141gb")
    assert planned.fits and planned.max_concurrent_sessions >= 8
    pod = deployment["spec"]["template"]["spec"]
    claim = by_kind(docs, "PersistentVolumeClaim")
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (init,) = pod["initContainers"]
    script = " ".join(init["command"])
    assert engine_args.model is not None and f"{engine_args.model}/config.json" in script
    assert "snapshot_download" in script and "exit 0" in script  # skipped when present
    (mount,) = container["volumeMounts"]
    assert mount["readOnly"] is True and engine_args.model.startswith(mount["mountPath"])


def test_cpu_overlay_serves_the_default_model_pulled_into_its_cache() -> None:
    deployment = by_kind(render("cpu"), "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    server = server_container(deployment)
    engine_args, _ = serve_args_from(parse_infer8(container_argv(server)))
    assert engine_args.model is None and engine_args.device == "cpu"
    (init,) = spec["initContainers"]
    assert container_argv(init) == ["infer8", "pull"]

    def cache_env(container: dict[str, Any]) -> str:
        (value,) = [e["value"] for e in container["env"] if e["name"] == "INFER8_CACHE"]
        return value

    assert cache_env(init) == cache_env(server)
    for container in (init, server):
        (mount,) = container["volumeMounts"]
        assert cache_env(container).startswith(mount["mountPath"] + "/")
    (volume,) = spec["volumes"]
    assert "emptyDir" in volume and "persistentVolumeClaim" not in volume
    assert server["image"].endswith(":cpu")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_service_and_scrape_use_the_server_endpoints(overlay: str) -> None:
    docs = render(overlay)
    deployment = by_kind(docs, "Deployment")
    template = deployment["spec"]["template"]
    container = server_container(deployment)
    _, server_config = serve_args_from(parse_infer8(container_argv(container)))
    (port,) = container["ports"]
    assert port["containerPort"] == server_config.port == 8000
    # liveness (and startup) on /health; readiness on /ready, which also fails while draining
    for probe, path in [("startupProbe", "/health"), ("readinessProbe", "/ready")] + [
        ("livenessProbe", "/health")
    ]:
        get = container[probe]["httpGet"]
        assert get["path"] == path and get["port"] == port["name"], probe
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    labels = template["metadata"]["labels"]
    service = by_kind(docs, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    pdb = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_matches_the_drain(overlay: str) -> None:
    deployment = by_kind(render(overlay), "Deployment")
    container = server_container(deployment)
    _, server_config = serve_args_from(parse_infer8(container_argv(container)))
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain_s = pre_stop_s + server_config.shutdown_grace_period_s
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # Enough for the drain plus a few seconds to exit, and not much more.
    assert drain_s + 5 <= grace_s <= drain_s + 30


def test_hpa_example_scales_the_deployment_on_the_queue_metric() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    hpa = yaml.safe_load((EXAMPLES / "hpa.yaml").read_text())
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    deployment = by_kind(render("gpu-h100-fp8"), "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm:num_requests_waiting"
    adapter = yaml.safe_load((EXAMPLES / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")


def test_inference_pool_example_selects_the_server_pods() -> None:
    pool = yaml.safe_load((EXAMPLES / "inferencepool.yaml").read_text())
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    deployment = by_kind(render("gpu-h100-fp8"), "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = server_container(deployment)["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]


# -- the Dockerfile -------------------------------------------------------------------------
def test_dockerfile_entrypoint_is_the_infer8_serve_command() -> None:
    tomllib = pytest.importorskip("tomllib")
    entrypoint = dockerfile_exec_form("ENTRYPOINT")
    argv = without_init(entrypoint)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts and scripts[argv[0]] == "infer8.cli:main"
    subcommands = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    assert argv[1:] == ["serve"] and "serve" in subcommands
    parse_infer8(argv + dockerfile_exec_form("CMD"))
    if entrypoint[0] == "tini":
        runs = " ".join(args for name, args in dockerfile_instructions() if name == "RUN")
        assert "install" in runs and " tini" in runs, "tini is used but never installed"


def test_dockerfile_runs_as_the_manifests_non_root_user_and_stops_on_sigterm() -> None:
    instructions = dockerfile_instructions()
    users = [args for name, args in instructions if name == "USER"]
    assert users, "the image must not run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid not in ("root", "0") and gid not in ("root", "0")
    assert [args for name, args in instructions if name == "STOPSIGNAL"] == ["SIGTERM"]
    assert ["8000"] == [args for name, args in instructions if name == "EXPOSE"]
    assert any(name == "VOLUME" and "/models" in args for name, args in instructions)
    for overlay in OVERLAYS:
        pod = by_kind(render(overlay), "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert str(pod["securityContext"]["runAsUser"]) == uid


def test_dockerfile_defaults_to_cpu_with_a_cuda_base_argument() -> None:
    instructions = dockerfile_instructions()
    args = {
        a.split("=", 1)[0]: a.split("=", 1)[1] for n, a in instructions if n == "ARG" and "=" in a
    }
    assert "cuda" not in args["BASE_IMAGE"] and args["TORCH_INDEX_URL"].endswith("/cpu")
    froms = [a for n, a in instructions if n == "FROM"]
    assert froms == ["${BASE_IMAGE}"]


def test_the_image_has_the_c_compiler_triton_and_the_cpu_kernels_need() -> None:
    runs = " ".join(args for name, args in dockerfile_instructions() if name == "RUN")
    assert " gcc" in runs and "libc6-dev" in runs
    assert "python3-dev" in runs  # Python.h where the CUDA base image's Python comes from apt


def test_dockerfile_installs_the_torch_and_triton_the_kernels_are_checked_with() -> None:
    """The image (CPU or CUDA recipe) gets torch at setup.sh's pin and every other package,
    Triton included, at scripts/constraints.txt's version, and the build context carries it."""
    instructions = dockerfile_instructions()
    args = dict(a.split("=", 1) for n, a in instructions if n == "ARG" and "=" in a)
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f'"{args["TORCH_SPEC"]}"' in setup, "the image's torch is not the one CI tests"
    assert "TORCH_SPEC=torch " not in (ROOT / "Dockerfile").read_text(), "an unpinned torch"
    constraints = (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
    assert any(line.startswith("triton==") for line in constraints)
    installs = [a for n, a in instructions if n == "RUN" and "/tmp/infer8-src" in a]
    assert installs and all("-c /tmp/infer8-src/scripts/constraints.txt" in a for a in installs)
    copies = [a.split() for n, a in instructions if n == "COPY"]
    assert ["scripts/constraints.txt", "/tmp/infer8-src/scripts/constraints.txt"] in copies
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!scripts/constraints.txt" in ignore, ".dockerignore keeps the constraints out"
