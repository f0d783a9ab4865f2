"""The inference-pool overlay: infer8 replicas behind an InferencePool and llm-d's endpoint picker.

Core objects validate against the Kubernetes schemas; the InferencePool, Gateway and HTTPRoute
(custom resources) against minimal schemas written here by hand from the Gateway API Inference
Extension's `api/v1/inferencepool_types.go` and Gateway API v1, covering only the fields the
overlay uses (unknown fields fail). The picker's config is checked against what infer8 sends it:
its KV events (endpoint, topic, block size, model name) and the metric names infer8 exports.
"""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from infer8.config import CacheConfig
from infer8.entrypoints.openai.cli_args import serve_args_from
from infer8.metrics import EngineMetrics
from tests.unit.test_deploy import (
    K8S,
    K8S_VERSION,
    Manifest,
    container_argv,
    parse_infer8,
    render,
    render_fallback,
)

OVERLAY = "inference-pool"
CUSTOM_KINDS = {"InferencePool", "Gateway", "HTTPRoute"}
# What llm-d's core-metrics-extractor reads from a vLLM server (its built-in "vllm" engine
# config in the inference scheduler: queue, running, KV usage, LoRA, cache info).
PICKER_VLLM_METRICS = {
    "queuedRequestsSpec": "vllm:num_requests_waiting",
    "runningRequestsSpec": "vllm:num_requests_running",
    "kvUsageSpec": "vllm:kv_cache_usage_perc",
    "loraSpec": "vllm:lora_requests_info",
    "cacheInfoSpec": "vllm:cache_config_info",
}

# -- minimal schemas of the custom resources (only the fields used; others fail) ------------
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "labels": {"type": "object"}},
    "additionalProperties": False,
}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
    }


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _object(
        ["apiVersion", "kind", "metadata", "spec"],
        apiVersion={"const": api_version},
        kind={"const": kind},
        metadata=_METADATA,
        spec=spec,
    )


INFERENCE_POOL_SCHEMA = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _object(
        ["selector", "targetPorts"],
        selector=_object(
            ["matchLabels"],
            matchLabels={
                "type": "object",
                "minProperties": 1,
                "maxProperties": 64,
                "additionalProperties": {"type": "string", "maxLength": 63},
            },
        ),
        targetPorts={
            "type": "array",
            "minItems": 1,
            "maxItems": 8,
            "items": _object(["number"], number=_PORT),
        },
        appProtocol={"enum": ["http", "kubernetes.io/h2c"]},
        endpointPickerRef=_object(
            ["name"],
            group={"type": "string"},
            kind={"type": "string"},
            name=_NAME,
            port=_object(["number"], number=_PORT),
            failureMode={"enum": ["FailOpen", "FailClose"]},
        ),
    ),
)
GATEWAY_SCHEMA = _resource(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    _object(
        ["gatewayClassName", "listeners"],
        gatewayClassName=_NAME,
        listeners={
            "type": "array",
            "minItems": 1,
            "items": _object(
                ["name", "port", "protocol"],
                name=_NAME,
                port=_PORT,
                protocol={"enum": ["HTTP", "HTTPS"]},
            ),
        },
    ),
)
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
HTTP_ROUTE_SCHEMA = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _object(
        ["parentRefs", "rules"],
        parentRefs={"type": "array", "minItems": 1, "items": _object(["name"], name=_NAME)},
        rules={
            "type": "array",
            "items": _object(
                ["backendRefs"],
                matches={
                    "type": "array",
                    "items": _object(
                        ["path"],
                        path=_object(
                            ["type", "value"],
                            type={"enum": ["Exact", "PathPrefix"]},
                            value={"type": "string", "pattern": "^/"},
                        ),
                    ),
                },
                backendRefs={
                    "type": "array",
                    "items": _object(
                        ["name"],
                        group={"type": "string"},
                        kind={"type": "string"},
                        name=_NAME,
                        port=_PORT,
                    ),
                },
                timeouts=_object([], request=_DURATION, backendRequest=_DURATION),
            ),
        },
    ),
)
CUSTOM_SCHEMAS = {
    "InferencePool": INFERENCE_POOL_SCHEMA,
    "Gateway": GATEWAY_SCHEMA,
    "HTTPRoute": HTTP_ROUTE_SCHEMA,
}


# -- helpers --------------------------------------------------------------------------------
def one(docs: list[Manifest], kind: str, name: str) -> Manifest:
    """Return the one manifest of a kind and name."""
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(deployment: Manifest, name: str) -> dict[str, Any]:
    """Return a Deployment's container by name."""
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found


def picker_config(docs: list[Manifest]) -> dict[str, Any]:
    """Return the EndpointPickerConfig the picker loads (--config-file, from its ConfigMap)."""
    epp = one(docs, "Deployment", "infer8-epp")
    args = container(epp, "epp")["args"]
    path = args[args.index("--config-file") + 1]
    directory, _, key = path.rpartition("/")
    (mount,) = [m for m in container(epp, "epp")["volumeMounts"] if m["mountPath"] == directory]
    volumes = {v["name"]: v for v in epp["spec"]["template"]["spec"]["volumes"]}
    config_map = one(docs, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    return yaml.safe_load(config_map["data"][key])


def plugin(config: dict[str, Any], plugin_type: str) -> dict[str, Any]:
    """Return the parameters of the one plugin of a type."""
    (found,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return found.get("parameters", {})


def expand_env(value: str, env: list[dict[str, Any]]) -> str:
    """Expand $(VAR) as the kubelet does: only variables the container defines are replaced."""
    fake = {"status.podIP": "10.1.2.3", "metadata.namespace": "serving"}
    values = {
        e["name"]: e["value"] if "value" in e else fake[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in env
    }
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values.get(m[1], m[0]), value)


def server_argv(docs: list[Manifest]) -> list[str]:
    """Return the serving container's command line after the kubelet's $(VAR) expansion."""
    server = container(one(docs, "Deployment", "infer8"), "infer8")
    return [expand_env(arg, server.get("env", [])) for arg in container_argv(server)]


# -- rendering and validation ---------------------------------------------------------------
def test_overlay_renders_the_pool_picker_and_route_around_four_replicas() -> None:
    docs = render(OVERLAY)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        [
            ("Deployment", "infer8"),
            ("Service", "infer8"),
            ("PodDisruptionBudget", "infer8"),
            ("PersistentVolumeClaim", "infer8-models"),
            ("InferencePool", "infer8"),
            ("Deployment", "infer8-epp"),
            ("Service", "infer8-epp"),
            ("ConfigMap", "infer8-epp"),
            ("ServiceAccount", "infer8-epp"),
            ("Role", "infer8-epp"),
            ("RoleBinding", "infer8-epp"),
            ("Gateway", "infer8"),
            ("HTTPRoute", "infer8"),
        ]
    )
    assert one(docs, "Deployment", "infer8")["spec"]["replicas"] == 4


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_fallback_renderer_matches_kustomize() -> None:
    def keyed(docs: list[Manifest]) -> dict[tuple[str, str], Manifest]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert keyed(render_fallback(K8S / "overlays" / OVERLAY)) == keyed(render(OVERLAY))


def test_core_objects_validate_against_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    core = [d for d in render(OVERLAY) if d["kind"] not in CUSTOM_KINDS]
    assert len(core) == 10
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_custom_resources_validate_against_their_schemas() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    custom = [d for d in render(OVERLAY) if d["kind"] in CUSTOM_KINDS]
    assert sorted(d["kind"] for d in custom) == sorted(CUSTOM_KINDS)
    for doc in custom:
        jsonschema.validate(doc, CUSTOM_SCHEMAS[doc["kind"]])


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("InferencePool", ["spec", "targetPort"], [{"number": 8000}]),  # misspelled field
        ("InferencePool", ["spec", "endpointPickerRef", "failureMode"], "Open"),
        ("InferencePool", ["spec", "targetPorts"], []),
        ("HTTPRoute", ["spec", "rules", 0, "timeouts", "request"], "5 minutes"),
        ("Gateway", ["spec", "listeners", 0, "port"], 0),
    ],
)
def test_custom_schemas_catch_mistakes(kind: str, path: list[Any], value: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    (doc,) = [d for d in render(OVERLAY) if d["kind"] == kind]
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, CUSTOM_SCHEMAS[kind])


# -- wiring ---------------------------------------------------------------------------------
def test_pool_selects_the_server_pods_and_routes_through_the_picker() -> None:
    docs = render(OVERLAY)
    pool = one(docs, "InferencePool", "infer8")
    server = one(docs, "Deployment", "infer8")
    picker = one(docs, "Deployment", "infer8-epp")
    selector = pool["spec"]["selector"]["matchLabels"].items()
    assert selector <= server["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= picker["spec"]["template"]["metadata"]["labels"].items()
    (port,) = container(server, "infer8")["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    # endpointPickerRef -> the picker Service's port -> the container's --grpc-port
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["kind"] == "Service"
    service = one(docs, "Service", ref["name"])
    assert (
        service["spec"]["selector"].items()
        <= picker["spec"]["template"]["metadata"]["labels"].items()
    )
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = container(picker, "epp")
    target = {p["name"]: p["containerPort"] for p in epp["ports"]}[service_port["targetPort"]]
    assert int(epp["args"][epp["args"].index("--grpc-port") + 1]) == target
    assert service_port["appProtocol"] == "http2"  # ext_proc is gRPC
    assert epp["args"][epp["args"].index("--pool-name") + 1] == pool["metadata"]["name"]
    # the route: Gateway -> HTTPRoute -> the pool, on the pool's port
    route = one(docs, "HTTPRoute", "infer8")
    gateway = one(docs, "Gateway", "infer8")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    assert {"number": backend["port"]} in pool["spec"]["targetPorts"]


def test_picker_can_watch_its_pool_and_pods() -> None:
    docs = render(OVERLAY)
    picker = one(docs, "Deployment", "infer8-epp")
    account = picker["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one(docs, "RoleBinding", "infer8-epp")
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    role = one(docs, "Role", binding["roleRef"]["name"])
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for verb in ("get", "list", "watch"):
        assert ("inference.networking.k8s.io", "inferencepools", verb) in granted
        assert ("", "pods", verb) in granted


def test_picker_runs_the_three_scorers_and_reads_vllm_metrics() -> None:
    config = picker_config(render(OVERLAY))
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    refs = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert set(refs) <= declared
    for source in config["dataLayer"]["sources"]:
        assert source["pluginRef"] in declared
        assert {e["pluginRef"] for e in source["extractors"]} <= declared
    for scorer in ("precise-prefix-cache-scorer", "kv-cache-utilization-scorer", "queue-scorer"):
        assert refs[scorer] > 0, scorer
    assert "max-score-picker" in refs
    (engine,) = plugin(config, "core-metrics-extractor")["engineConfigs"]
    assert engine["name"] == "vllm"
    for key, name in PICKER_VLLM_METRICS.items():
        # the picker's built-in vLLM names, except the LoRA read (exported under --enable-lora only)
        assert engine[key] == ("" if key == "loraSpec" else name), key


def test_server_pods_publish_kv_events_to_the_picker() -> None:
    docs = render(OVERLAY)
    argv = server_argv(docs)
    engine_args, server_config = serve_args_from(parse_infer8(argv))
    events = engine_args.create_kv_events_config()
    assert events.is_enabled and events.publisher == "zmq"
    # Centralized: the picker binds, every pod connects to its Service.
    config = picker_config(docs)
    scorer = plugin(config, "precise-prefix-cache-scorer")
    kv_events = scorer["kvEventsConfig"]
    assert kv_events["discoverPods"] is False
    bind_host, _, bind_port = kv_events["zmqEndpoint"].removeprefix("tcp://").rpartition(":")
    assert bind_host in ("*", "0.0.0.0")
    host, _, port = events.endpoint.removeprefix("tcp://").rpartition(":")
    assert "*" not in host and "::" not in host  # infer8 connects rather than binds
    service = one(docs, "Service", host)
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    epp = container(one(docs, "Deployment", "infer8-epp"), "epp")
    container_ports = {p["name"]: p["containerPort"] for p in epp["ports"]}
    assert container_ports[service_port["targetPort"]] == int(bind_port)
    # Topic kv@<pod IP>:<port>@<model>: llm-d keys a pod's blocks by the part between the @s
    # and looks them up as the pool endpoint's "<address>:<port>".
    assert events.topic.startswith(kv_events["topicFilter"])
    pod_id, model = events.topic.split("@")[1:]
    assert pod_id == f"10.1.2.3:{server_config.port}"
    assert model == engine_args.served_model_name
    assert {"number": server_config.port} in one(docs, "InferencePool", "infer8")["spec"][
        "targetPorts"
    ]
    # The picker hashes prompt tokens in blocks of the replicas' size, with their tokenizer.
    assert scorer["tokenProcessorConfig"]["blockSize"] == engine_args.block_size
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == model
    assert plugin(config, "tokenizer")["modelName"] == model
    assert engine_args.enable_prefix_caching  # without it there are no events to send


def test_pod_ip_comes_from_the_downward_api() -> None:
    server = container(one(render(OVERLAY), "Deployment", "infer8"), "infer8")
    (pod_ip,) = [e for e in server["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    raw = server["args"][server["args"].index("--kv-events-config") + 1]
    assert "$(POD_IP)" in json.loads(raw)["topic"]


def test_readiness_and_drain_keep_requests_off_a_stopping_replica() -> None:
    docs = render(OVERLAY)
    server = one(docs, "Deployment", "infer8")
    infer8 = container(server, "infer8")
    _, server_config = serve_args_from(parse_infer8(server_argv(docs)))
    # The picker routes only to Ready pods; /ready fails from SIGTERM on.
    assert infer8["readinessProbe"]["httpGet"]["path"] == "/ready"
    pre_stop_s = infer8["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace_s = server["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > pre_stop_s + server_config.shutdown_grace_period_s
    # The route lets a request run as long as the drain lets it finish.
    (rule,) = one(docs, "HTTPRoute", "infer8")["spec"]["rules"]
    timeout = rule["timeouts"]["request"]
    assert timeout.endswith("s") and int(timeout[:-1]) >= server_config.shutdown_grace_period_s


# -- the metrics the picker reads, against what infer8 exports --------------------------------
def exported_metrics(block_size: int) -> dict[str, Any]:
    """Return the metric families of a server's /metrics text, by name."""
    metrics = EngineMetrics("Qwen/Qwen2-72B-Instruct", CacheConfig(block_size=block_size), 1000)
    text = generate_latest(metrics.registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_infer8_exports_every_metric_the_picker_reads() -> None:
    config = picker_config(render(OVERLAY))
    (engine,) = plugin(config, "core-metrics-extractor")["engineConfigs"]
    block_size = plugin(config, "precise-prefix-cache-scorer")["tokenProcessorConfig"]["blockSize"]
    families = exported_metrics(block_size)
    read = {key: name for key, name in engine.items() if key.endswith("Spec") and name}
    assert set(read) == set(PICKER_VLLM_METRICS) - {"loraSpec"}
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        assert families[read[key]].type == "gauge", key
    # cache info: the block size and block count, as labels of an info gauge
    (sample,) = families[read["cacheInfoSpec"]].samples
    assert sample.labels["block_size"] == str(block_size)
    assert sample.labels["num_gpu_blocks"] == "1000"
    assert PICKER_VLLM_METRICS["loraSpec"] not in families  # no --enable-lora: the read is off


def test_metric_check_fails_for_a_name_infer8_does_not_export() -> None:
    families = exported_metrics(16)
    assert "vllm:num_requests_waiting" in families
    assert "vllm:num_requests_queued" not in families
