"""deploy/k8s and deploy/docker: the manifests validate offline and keep the deployment's
security invariants (SPEC B-DEPLOY, R-ROLE-2).

* Every built-in Kubernetes resource is validated by kubernetes-validate in strict mode
  (unknown fields are errors) against one Kubernetes version; a built-in kind without a
  bundled schema is a failure, never a warning.
* Custom resources (CloudNativePG, cert-manager, trust-manager) have no bundled schema:
  each kind gets a structural check here, and any other kind fails.
* The kustomizations are rendered by a small reader below (resources, namespace, images,
  secretGenerator with stable names, JSON 6902 patches) with no kubectl and no network;
  it refuses any kustomization feature it does not implement, so a rendering it cannot
  reproduce fails instead of passing unchecked.

kubernetes-validate is a dev dependency: without it this module fails to import, loudly.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml
from qinglong_control.db.bootstrap import CLOSE_ADVISORY_LOCKS
from qinglong_control.db.pool import ADMIN_POOL_MAX_SIZE, RECONCILER_POOL_MAX_SIZE
from qinglong_protocol import bounds
from qinglong_protocol.pooling import ENV_POOL_MAX_SIZE, default_max_size
from qinglong_worker.heartbeat import DEFAULT_STALE_SECONDS
from qinglong_worker.join import IDENTITY_FILE
from qinglong_worker.settings import parse_worker_settings

try:
    import kubernetes_validate
except ImportError as error:  # no skip: a validation that silently does not run proves nothing
    raise ImportError(
        "kubernetes-validate is missing: it is a dev dependency of the workspace "
        "(pyproject.toml [dependency-groups] dev); run `make bootstrap`"
    ) from error

Resource = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DEV_OVERLAY = K8S / "overlays" / "dev"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"

# The oldest Kubernetes minor the manifests support (they use PodDisruptionBudget
# unhealthyPodEvictionPolicy, topology-spread matchLabelKeys and the preStop sleep action).
KUBERNETES_VERSION = "1.33"
NAMESPACE = "qinglong"
POSTGRES_CLUSTER = "qinglong-pg"
POSTGRES_CA_SECRET = f"{POSTGRES_CLUSTER}-ca"
PLACEHOLDER_MARK = "CHANGE-ME"
TRUST_DOMAIN = "qinglong.local"

CONTROL = "qinglong-control"
INGRESS = "qinglong-ingress"
MIGRATE = "qinglong-migrate"
WORKER = "qinglong-worker"
WORKLOAD_KIND = {
    CONTROL: "Deployment",
    INGRESS: "Deployment",
    MIGRATE: "Job",
    WORKER: "StatefulSet",
}

# cert-manager's CA Secret (Certificate qinglong-ca): it signs every certificate, and
# control signs joining Workers' certificates with it (the issuing CA).
CA_SECRET = "qinglong-ca"
# Its certificate alone, copied by trust-manager (Bundle of the same name) into a
# ConfigMap: what a pod that must not name the CA's Secret (a Worker) mounts.
CA_BUNDLE = "qinglong-ca-bundle"
WORKER_JOIN_SECRET = "qinglong-worker-join"
# ingress's two listeners: mutual TLS, and Worker enrollment (server-authenticated TLS).
PUBLIC_PORT = 8443
ENROLLMENT_PORT = 9443
#: Prometheus /metrics of control, ingress and the Worker (docs/observability.md), and
#: where Prometheus and the OpenTelemetry collector run.
METRICS_PORT = 9090
OTLP_PORT = 4317
MONITORING = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
COLLECTOR_POD = {"matchLabels": {"app.kubernetes.io/name": "opentelemetry-collector"}}
INGRESS_HOST = f"{INGRESS}.{NAMESPACE}.svc.cluster.local"

# One Secret per database role; the role names are qinglong_control.db.roles.
DB_SECRET_OF_ROLE = {
    "qinglong_migration": "qinglong-db-migration",
    "qinglong_runtime": "qinglong-db-runtime",
    "qinglong_ingress": "qinglong-db-ingress",
    "qinglong_admin": "qinglong-db-admin",
}
DB_URL_VARIABLES = {
    "QINGLONG_MIGRATION_DATABASE_URL",
    "QINGLONG_DATABASE_URL",
    "QINGLONG_INGRESS_DATABASE_URL",
    "QINGLONG_CONTROL_ADMIN_DATABASE_URL",
}

# Pod labels of the workloads (what Services, PDBs and NetworkPolicies select).
CONTROL_POD = {"app.kubernetes.io/name": "qinglong", "app.kubernetes.io/component": "control"}
INGRESS_POD = {"app.kubernetes.io/name": "qinglong", "app.kubernetes.io/component": "ingress"}
MIGRATE_POD = {"app.kubernetes.io/name": "qinglong", "app.kubernetes.io/component": "migrate"}
WORKER_POD = {"app.kubernetes.io/name": "qinglong", "app.kubernetes.io/component": "worker"}
POSTGRES_POD = {"cnpg.io/cluster": POSTGRES_CLUSTER, "cnpg.io/podRole": "instance"}
# Pods that must never reach control or PostgreSQL: unlabelled, a stranger that borrows
# the app name, the database itself.
STRANGER_PODS = (
    {},
    {"app.kubernetes.io/name": "qinglong"},
    {"app.kubernetes.io/name": "qinglong", "app.kubernetes.io/component": "debug"},
    {"app": "qinglong-ingress"},
)

KUSTOMIZATION_FILE = "kustomization.yaml"
KUSTOMIZATION_KEYS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "images",
    "generatorOptions",
    "secretGenerator",
    "patches",
}
CLUSTER_SCOPED_KINDS = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "ClusterIssuer",
    "PriorityClass",
    "StorageClass",
}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}
BUILTIN_GROUPS = {"", "apps", "batch", "policy", "autoscaling"}


# --- loading and rendering -------------------------------------------------------------


def _documents(path: Path) -> list[Resource]:
    documents = []
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if document is None:
            continue
        assert isinstance(document, dict), f"{path}: a YAML document is not a mapping"
        documents.append(document)
    return documents


def _yaml_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in {".yaml", ".yml"})


def _kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob(KUSTOMIZATION_FILE))


def _relative(path: Path) -> str:
    return path.relative_to(K8S).as_posix() or "."


def _load_kustomization(directory: Path) -> Resource:
    path = directory / KUSTOMIZATION_FILE
    assert path.is_file(), f"{directory}: no {KUSTOMIZATION_FILE}"
    (kustomization,) = _documents(path)
    assert kustomization.get("apiVersion") == "kustomize.config.k8s.io/v1beta1", path
    assert kustomization.get("kind") == "Kustomization", path
    unsupported = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unsupported, (
        f"{path}: {sorted(unsupported)} are not reproduced by this test's renderer; "
        "extend the renderer before using them"
    )
    return kustomization


def _resource_paths(directory: Path) -> list[Path]:
    """The `resources:` entries of one kustomization, resolved and checked like kustomize's
    default load restrictor: a file must lie inside the kustomization's own directory;
    anything outside it must be a directory holding another kustomization."""
    paths = []
    for entry in _load_kustomization(directory).get("resources", []):
        assert "://" not in entry, f"{directory}: remote resource {entry!r}"
        path = (directory / entry).resolve()
        if path.is_dir():
            assert (path / KUSTOMIZATION_FILE).is_file(), f"{path}: not a kustomization"
        else:
            assert path.is_file(), f"{directory}: missing resource {entry!r}"
            assert path.is_relative_to(directory.resolve()), (
                f"{directory}: file {entry!r} is outside the kustomization root"
            )
        paths.append(path)
    return paths


@functools.cache
def _render(directory: Path) -> tuple[Resource, ...]:
    kustomization = _load_kustomization(directory)
    resources: list[Resource] = []
    for path in _resource_paths(directory):
        if path.is_dir():
            resources += copy.deepcopy(list(_render(path)))
        else:
            resources += _documents(path)
    resources += _generated_secrets(directory, kustomization)
    for patch in kustomization.get("patches", []):
        _apply_patch(directory, patch, resources)
    namespace = kustomization.get("namespace")
    if namespace is not None:
        for resource in resources:
            _set_namespace(resource, namespace)
    for image in kustomization.get("images", []):
        for resource in resources:
            _set_image(resource, image)
    seen: set[tuple[str, str, str | None, str]] = set()
    for resource in resources:
        key = _identity(resource)
        assert key not in seen, f"{directory}: {key} is defined twice"
        seen.add(key)
    return tuple(resources)


def _generated_secrets(directory: Path, kustomization: Resource) -> list[Resource]:
    generators = kustomization.get("secretGenerator", [])
    if not generators:
        return []
    options = kustomization.get("generatorOptions", {})
    assert set(options) <= {"disableNameSuffixHash", "labels", "annotations"}, directory
    # With a hash suffix kustomize renames the Secret and rewrites references in built-in
    # kinds only; custom resources (CloudNativePG) would keep the old name.
    assert options.get("disableNameSuffixHash") is True, (
        f"{directory}: generated Secrets must keep stable names (disableNameSuffixHash)"
    )
    secrets = []
    for generator in generators:
        assert set(generator) <= {"name", "type", "literals"}, (directory, generator)
        data = {}
        for literal in generator.get("literals", []):
            key, separator, value = literal.partition("=")
            assert separator, f"{directory}: bad literal {literal!r}"
            assert key, f"{directory}: bad literal {literal!r}"
            data[key] = base64.b64encode(value.encode()).decode()
        metadata_: Resource = {"name": generator["name"]}
        if options.get("labels"):
            metadata_["labels"] = dict(options["labels"])
        if options.get("annotations"):
            metadata_["annotations"] = dict(options["annotations"])
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": metadata_,
                "type": generator.get("type", "Opaque"),
                "data": data,
            }
        )
    return secrets


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), f"JSON pointer {path!r}"
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _json_patch(resource: Resource, operation: Mapping[str, Any]) -> None:
    """One RFC 6902 add/replace/remove, as kustomize applies it: a replaced or removed
    member must exist."""
    op = operation["op"]
    assert op in {"add", "replace", "remove"}, f"patch op {op!r} is not reproduced here"
    assert set(operation) == ({"op", "path"} if op == "remove" else {"op", "path", "value"})
    *parents, last = _pointer(operation["path"])
    node: Any = resource
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        if op == "add":
            node.insert(len(node) if last == "-" else int(last), operation["value"])
        elif op == "replace":
            node[int(last)] = operation["value"]
        else:
            del node[int(last)]
        return
    assert isinstance(node, dict), operation
    if op != "add":
        assert last in node, f"{operation['path']}: nothing to {op}"
    if op == "remove":
        del node[last]
    else:
        node[last] = operation["value"]


def _apply_patch(directory: Path, patch: Resource, resources: list[Resource]) -> None:
    """An inline JSON 6902 patch with a target. kustomize patches nothing, silently,
    when the target matches nothing: here that fails, as does a target matching more
    than one resource."""
    assert set(patch) == {"target", "patch"}, f"{directory}: {sorted(patch)}"
    target = patch["target"]
    assert set(target) <= {"group", "version", "kind", "name"}, f"{directory}: {target}"
    assert {"kind", "name"} <= set(target), f"{directory}: {target}"
    operations = yaml.safe_load(patch["patch"])
    assert isinstance(operations, list), f"{directory}: only JSON 6902 patches are reproduced"

    def matches(resource: Resource) -> bool:
        group, _, version = resource["apiVersion"].rpartition("/")
        wanted = {"group": group, "version": version, "kind": resource["kind"]}
        wanted["name"] = resource["metadata"]["name"]
        return all(wanted[key] == value for key, value in target.items())

    found = [resource for resource in resources if matches(resource)]
    assert len(found) == 1, f"{directory}: the patch target {target} matches {len(found)}"
    for operation in operations:
        _json_patch(found[0], operation)


def _set_namespace(resource: Resource, namespace: str) -> None:
    if resource["kind"] == "Namespace":
        # kustomize would rename it; a kustomization here must not depend on that.
        assert resource["metadata"]["name"] == namespace, resource["metadata"]["name"]
    elif resource["kind"] not in CLUSTER_SCOPED_KINDS:
        resource["metadata"]["namespace"] = namespace


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    name, _, digest = image.partition("@")
    tag = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
    return name, tag, digest or None


def _set_image(resource: Resource, rule: Mapping[str, str]) -> None:
    assert set(rule) <= {"name", "newName", "newTag", "digest"}, rule
    for container in _containers(resource):
        name, tag, digest = _split_image(container["image"])
        if name != rule["name"]:
            continue
        name = rule.get("newName", name)
        if "digest" in rule:
            container["image"] = f"{name}@{rule['digest']}"
            continue
        tag = rule.get("newTag", tag)
        image = f"{name}:{tag}" if tag else name
        container["image"] = f"{image}@{digest}" if digest and "newTag" not in rule else image


def _identity(resource: Resource) -> tuple[str, str, str | None, str]:
    group = resource["apiVersion"].rpartition("/")[0]
    metadata_ = resource["metadata"]
    return group, resource["kind"], metadata_.get("namespace"), metadata_["name"]


def _label(resource: Resource) -> str:
    return f"{resource['kind']}/{resource['metadata']['name']}"


# --- selectors and pod specs --------------------------------------------------------------


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes LabelSelector semantics ({} selects everything)."""
    if selector is None:
        return False
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _pod_spec(workload: Resource) -> Resource:
    spec: Resource = workload["spec"]["template"]["spec"]
    return spec


def _pod_labels(workload: Resource) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _containers(resource: Resource) -> Iterator[Resource]:
    if resource["kind"] not in POD_TEMPLATE_KINDS:
        return
    spec = _pod_spec(resource)
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def _secret_references(pod_spec: Resource) -> set[str]:
    names = set()
    for container in [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]:
        for variable in container.get("env", []):
            reference = variable.get("valueFrom", {}).get("secretKeyRef")
            if reference is not None:
                names.add(reference["name"])
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                names.add(source["secretRef"]["name"])
    for volume in pod_spec.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    names.update(reference["name"] for reference in pod_spec.get("imagePullSecrets", []))
    return names


def _env(container: Resource) -> dict[str, Resource]:
    return {variable["name"]: variable for variable in container.get("env", [])}


def _env_value(container: Resource, name: str) -> str:
    value = _env(container)[name]["value"]
    assert isinstance(value, str)
    return value


def _mounted_file(pod_spec: Resource, container: Resource, path: str) -> tuple[str, str, str]:
    """(kind, name, key) of the Secret or ConfigMap behind a file path in `container`,
    or fail."""
    file = PurePosixPath(path)
    volumes = {volume["name"]: volume for volume in pod_spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if PurePosixPath(mount["mountPath"]) != file.parent:
            continue
        assert mount.get("readOnly") is True, f"{mount['mountPath']} must be mounted read-only"
        volume = volumes[mount["name"]]
        if "secret" in volume:
            kind, source, name = "Secret", volume["secret"], volume["secret"]["secretName"]
        elif "configMap" in volume:
            kind, source, name = "ConfigMap", volume["configMap"], volume["configMap"]["name"]
        else:
            pytest.fail(f"{path} is in neither a Secret nor a ConfigMap volume")
        items = {item["path"]: item["key"] for item in source.get("items", [])}
        assert file.name in items, f"{path}: the {kind} volume does not project {file.name}"
        return kind, name, items[file.name]
    pytest.fail(f"{path}: no volume is mounted at {file.parent}")


def _mounted_secret_file(pod_spec: Resource, container: Resource, path: str) -> tuple[str, str]:
    """(Secret name, key) behind a file path in `container`, or fail."""
    kind, name, key = _mounted_file(pod_spec, container, path)
    assert kind == "Secret", f"{path} is not in a Secret volume"
    return name, key


# --- the rendered deployment ----------------------------------------------------------------


def _dev() -> tuple[Resource, ...]:
    return _render(DEV_OVERLAY)


def _find(kind: str, name: str) -> Resource:
    found = [r for r in _dev() if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found in the dev overlay"
    return found[0]


def _of_kind(kind: str) -> list[Resource]:
    return [r for r in _dev() if r["kind"] == kind]


def _workloads() -> list[Resource]:
    return [r for r in _dev() if r["kind"] in POD_TEMPLATE_KINDS]


def _only_container(workload: Resource) -> Resource:
    (container,) = _pod_spec(workload)["containers"]
    assert not _pod_spec(workload).get("initContainers"), _label(workload)
    return container


# --- schema validation -----------------------------------------------------------------------


def _is_builtin(resource: Resource) -> bool:
    group = resource["apiVersion"].rpartition("/")[0]
    return group in BUILTIN_GROUPS or group.endswith(".k8s.io")


def _all_rendered() -> list[tuple[str, Resource]]:
    rendered = []
    for directory in _kustomization_dirs():
        for resource in _render(directory):
            rendered.append((f"{_relative(directory)}:{_label(resource)}", resource))
    return rendered


RENDERED = _all_rendered()


def test_kubernetes_validate_bundles_the_target_version() -> None:
    newest = tuple(int(part) for part in kubernetes_validate.latest_version().split(".")[:2])
    target = tuple(int(part) for part in KUBERNETES_VERSION.split("."))
    assert newest >= target, f"kubernetes-validate {kubernetes_validate.__version__} is too old"


@pytest.mark.parametrize(
    "resource",
    [resource for _, resource in RENDERED if _is_builtin(resource)],
    ids=[name for name, resource in RENDERED if _is_builtin(resource)],
)
def test_builtin_resources_validate_strictly(resource: Resource) -> None:
    try:
        version = kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as error:
        pytest.fail(f"no schema for a built-in kind: {error.message}")
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(part) for part in error.path)
        pytest.fail(f"{_label(resource)}: {where}: {error.message}")
    assert version == KUBERNETES_VERSION


def _check_cnpg_cluster(cluster: Resource) -> None:
    spec = cluster["spec"]
    # spec.instances is the one field the CRD requires.
    assert isinstance(spec["instances"], int)
    assert spec["instances"] >= 1
    assert set(spec) <= {
        "instances",
        "imageName",
        "primaryUpdateStrategy",
        "enableSuperuserAccess",
        "postgresql",
        "bootstrap",
        "managed",
        "storage",
        "walStorage",
        "resources",
        "affinity",
    }, sorted(spec)
    assert set(spec["bootstrap"]) == {"initdb"}
    initdb = spec["bootstrap"]["initdb"]
    assert {"database", "owner", "secret"} <= set(initdb)
    assert isinstance(initdb["secret"]["name"], str)
    for statement in initdb.get("postInitApplicationSQL", []):
        assert isinstance(statement, str)
    # Advisory locks closed to the ingress role, by the very statement the dev stack runs.
    assert initdb["postInitApplicationSQL"][-1].strip() == CLOSE_ADVISORY_LOCKS
    for role in spec["managed"]["roles"]:
        assert set(role) <= {
            "name",
            "ensure",
            "comment",
            "login",
            "superuser",
            "createdb",
            "createrole",
            "replication",
            "bypassrls",
            "inherit",
            "connectionLimit",
            "passwordSecret",
        }, role
        assert role.get("ensure", "present") in {"present", "absent"}
        assert set(role["passwordSecret"]) == {"name"}
    assert re.fullmatch(r"\d+(Mi|Gi|Ti)", spec["storage"]["size"])
    synchronous = spec["postgresql"]["synchronous"]
    assert synchronous["method"] in {"any", "first"}
    assert synchronous.get("dataDurability", "required") in {"required", "preferred"}


CERTIFICATE_USAGES = {"digital signature", "key encipherment", "server auth", "client auth"}


def _check_certificate(certificate: Resource) -> None:
    spec = certificate["spec"]
    assert isinstance(spec["secretName"], str)
    assert spec["issuerRef"]["name"]
    assert spec["issuerRef"].get("kind", "Issuer") in {"Issuer", "ClusterIssuer"}
    assert any(spec.get(field) for field in ("commonName", "dnsNames", "uris", "ipAddresses"))
    assert set(spec.get("usages", [])) <= CERTIFICATE_USAGES, spec.get("usages")
    key = spec["privateKey"]
    assert (key["algorithm"], key["size"]) in {("RSA", 2048), ("RSA", 3072), ("ECDSA", 256)}
    identity = re.compile(rf"spiffe://{re.escape(TRUST_DOMAIN)}/(service|worker|operator)/\S+")
    for uri in spec.get("uris", []):
        assert identity.fullmatch(uri), uri


def _check_issuer(issuer: Resource) -> None:
    (kind,) = issuer["spec"]
    assert kind in {"selfSigned", "ca"}
    if kind == "ca":
        assert isinstance(issuer["spec"]["ca"]["secretName"], str)


def _check_bundle(bundle: Resource) -> None:
    """trust-manager's Bundle (trust.cert-manager.io/v1alpha1, the CRD's fields)."""
    spec = bundle["spec"]
    assert set(spec) == {"sources", "target"}, sorted(spec)
    assert spec["sources"], "a Bundle with no source"
    for source in spec["sources"]:
        (kind,) = source
        assert kind in {"secret", "configMap", "inLine", "useDefaultCAs"}, kind
        if kind in {"secret", "configMap"}:
            assert set(source[kind]) == {"name", "key"}, source
    target = spec["target"]
    assert set(target) <= {"configMap", "secret", "namespaceSelector", "additionalFormats"}
    assert "configMap" in target or "secret" in target
    for kind in ("configMap", "secret"):
        if kind in target:
            assert set(target[kind]) == {"key"}, target
    assert set(target.get("namespaceSelector", {})) <= {"matchLabels"}


CUSTOM_KINDS = {
    ("postgresql.cnpg.io/v1", "Cluster"): _check_cnpg_cluster,
    ("cert-manager.io/v1", "Certificate"): _check_certificate,
    ("cert-manager.io/v1", "Issuer"): _check_issuer,
    ("trust.cert-manager.io/v1alpha1", "Bundle"): _check_bundle,
}


@pytest.mark.parametrize(
    "resource",
    [resource for _, resource in RENDERED if not _is_builtin(resource)],
    ids=[name for name, resource in RENDERED if not _is_builtin(resource)],
)
def test_custom_resources_have_a_structural_check(resource: Resource) -> None:
    check = CUSTOM_KINDS.get((resource["apiVersion"], resource["kind"]))
    assert check is not None, (
        f"{resource['apiVersion']} {resource['kind']}: no bundled schema and no check here"
    )
    assert isinstance(resource["metadata"]["name"], str)
    check(resource)


# --- layout ------------------------------------------------------------------------------------


def test_every_manifest_is_reachable_from_the_dev_overlay() -> None:
    reached: set[Path] = set()

    def walk(directory: Path) -> None:
        reached.add((directory / KUSTOMIZATION_FILE).resolve())
        for path in _resource_paths(directory):
            if path.is_dir():
                walk(path)
            else:
                reached.add(path)

    walk(DEV_OVERLAY)
    files = {path.resolve() for path in _yaml_files()}
    assert all(path.suffix == ".yaml" for path in files), "use .yaml"
    assert files - reached == set(), "manifests no kustomization includes"


def test_no_secret_values_are_committed_outside_the_example_overlay() -> None:
    for path in _yaml_files():
        if path.name == KUSTOMIZATION_FILE:
            continue
        kinds = {document.get("kind") for document in _documents(path)}
        assert "Secret" not in kinds, f"{_relative(path)}: Secrets belong to an overlay"


def test_everything_lives_in_the_namespace_with_the_restricted_pod_security_level() -> None:
    namespace = _find("Namespace", NAMESPACE)
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    for resource in _dev():
        if resource["kind"] not in CLUSTER_SCOPED_KINDS:
            assert resource["metadata"]["namespace"] == NAMESPACE, _label(resource)


# --- database roles: who holds which credential ----------------------------------------------


def _db_secrets_referenced(workload: Resource) -> set[str]:
    return _secret_references(_pod_spec(workload)) & set(DB_SECRET_OF_ROLE.values())


def _all_text(resource: Resource) -> str:
    return json.dumps(resource, sort_keys=True)


def test_control_holds_only_the_runtime_and_admin_roles_and_the_issuing_ca() -> None:
    control = _find("Deployment", CONTROL)
    assert _secret_references(_pod_spec(control)) == {
        "qinglong-db-runtime",
        "qinglong-db-admin",
        "qinglong-control-tls",
        POSTGRES_CA_SECRET,
        CA_SECRET,
    }
    container = _only_container(control)
    env = _env(container)
    # Every variable naming a Secret-backed value, and what it names.
    secret_env = {name for name, variable in env.items() if "valueFrom" in variable}
    assert secret_env == {"QINGLONG_DATABASE_URL", "QINGLONG_CONTROL_ADMIN_DATABASE_URL"}
    issuing = {
        variable: _mounted_secret_file(
            _pod_spec(control), container, _env_value(container, variable)
        )
        for variable in ("QINGLONG_CONTROL_ISSUING_CA_CERT", "QINGLONG_CONTROL_ISSUING_CA_KEY")
    }
    assert issuing == {
        "QINGLONG_CONTROL_ISSUING_CA_CERT": (CA_SECRET, "tls.crt"),
        "QINGLONG_CONTROL_ISSUING_CA_KEY": (CA_SECRET, "tls.key"),
    }
    days = float(_env_value(container, "QINGLONG_CONTROL_WORKER_CERTIFICATE_DAYS"))
    assert 0 < days <= 7, "Worker certificates are short-lived (R-ADM-2)"
    assert env["QINGLONG_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "qinglong-db-runtime",
        "key": "url",
    }
    assert env["QINGLONG_CONTROL_ADMIN_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "qinglong-db-admin",
        "key": "url",
    }
    assert DB_URL_VARIABLES & set(env) == {
        "QINGLONG_DATABASE_URL",
        "QINGLONG_CONTROL_ADMIN_DATABASE_URL",
    }


def test_ingress_never_sees_the_runtime_or_migration_role() -> None:
    ingress = _find("Deployment", INGRESS)
    assert _secret_references(_pod_spec(ingress)) == {
        "qinglong-db-ingress",
        "qinglong-ingress-tls",
        "qinglong-ingress-client-tls",
        POSTGRES_CA_SECRET,
    }
    env = _env(_only_container(ingress))
    assert env["QINGLONG_INGRESS_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "qinglong-db-ingress",
        "key": "url",
    }
    assert DB_URL_VARIABLES & set(env) == {"QINGLONG_INGRESS_DATABASE_URL"}
    text = _all_text(ingress)
    for forbidden in (
        "qinglong-db-runtime",
        "qinglong-db-migration",
        "qinglong-db-admin",
        "qinglong_runtime",
        "qinglong_admin",
    ):
        assert forbidden not in text


def test_the_migration_job_holds_only_the_migration_role() -> None:
    job = _find("Job", MIGRATE)
    assert _secret_references(_pod_spec(job)) == {
        "qinglong-db-migration",
        "qinglong-admin-token",
        POSTGRES_CA_SECRET,
    }
    for container in _containers(job):
        env = _env(container)
        assert set(env) == {"QINGLONG_MIGRATION_DATABASE_URL"}
        assert env["QINGLONG_MIGRATION_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": "qinglong-db-migration",
            "key": "url",
        }


def test_the_migration_job_migrates_then_enrolls_the_first_cluster_admin() -> None:
    """bootstrap-admin needs the migrated schema, so migrate is the init container; the
    token comes from a mounted Secret (read-only, owner-only), never from the API."""
    spec = _pod_spec(_find("Job", MIGRATE))
    (migrate,) = spec["initContainers"]
    (bootstrap,) = spec["containers"]
    assert migrate["command"] == ["qinglong-control", "migrate"]
    assert bootstrap["command"][:3] == ["qinglong-control", "bootstrap-admin", "--token-from-file"]
    token_path = bootstrap["command"][3]
    (mount,) = [m for m in bootstrap["volumeMounts"] if m["name"] == "admin-token"]
    assert mount["readOnly"] is True
    assert token_path == f"{mount['mountPath']}/token"
    (volume,) = [v for v in spec["volumes"] if v["name"] == "admin-token"]
    assert volume["secret"]["secretName"] == "qinglong-admin-token"
    assert volume["secret"]["defaultMode"] == 0o400
    secret = _find("Secret", "qinglong-admin-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert PLACEHOLDER_MARK in token, "a marked placeholder, not a secret"
    assert bounds.OPERATOR_TOKEN_PATTERN.match(token), "in the shape bootstrap-admin accepts"


def test_each_role_secret_is_held_by_exactly_one_workload() -> None:
    holders: dict[str, list[str]] = {}
    for workload in _workloads():
        for secret in _db_secrets_referenced(workload):
            holders.setdefault(secret, []).append(workload["metadata"]["name"])
    assert holders == {
        "qinglong-db-runtime": [CONTROL],
        "qinglong-db-ingress": [INGRESS],
        "qinglong-db-migration": [MIGRATE],
        "qinglong-db-admin": [CONTROL],
    }


def test_the_postgres_ca_volume_projects_only_the_certificate() -> None:
    for workload in _workloads():
        for volume in _pod_spec(workload).get("volumes", []):
            secret = volume.get("secret", {})
            if secret.get("secretName") == POSTGRES_CA_SECRET:
                # The CloudNativePG CA Secret also holds the CA's private key.
                assert secret["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_role_secrets_are_placeholders_that_match_the_postgres_cluster() -> None:
    cluster = _find("Cluster", POSTGRES_CLUSTER)
    ca_paths = set()
    for workload in _workloads():
        for container in _containers(workload):
            for mount in container.get("volumeMounts", []):
                if mount["name"] == "postgres-ca":
                    ca_paths.add(f"{mount['mountPath']}/ca.crt")
    (ca_path,) = ca_paths
    for role, secret_name in DB_SECRET_OF_ROLE.items():
        secret = _find("Secret", secret_name)
        assert secret["type"] == "kubernetes.io/basic-auth"
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        assert set(data) == {"username", "password", "url"}
        assert data["username"] == role
        assert PLACEHOLDER_MARK in data["password"], f"{secret_name}: not a marked placeholder"
        url = urlsplit(data["url"])
        assert url.scheme == "postgresql"
        assert unquote(url.username or "") == role
        assert unquote(url.password or "") == data["password"]
        assert url.hostname == f"{POSTGRES_CLUSTER}-rw.{NAMESPACE}.svc"  # in the server cert
        assert url.port == 5432
        assert url.path == "/" + cluster["spec"]["bootstrap"]["initdb"]["database"]
        query = parse_qs(url.query)
        assert query["sslmode"] == ["verify-full"]
        assert query["sslrootcert"] == [ca_path]
        if role != "qinglong_migration":
            # SPEC R-HA-2: the services refuse a demoted primary the Service still names.
            assert query["target_session_attrs"] == ["read-write"]


def test_the_postgres_cluster_manages_one_role_per_secret() -> None:
    cluster = _find("Cluster", POSTGRES_CLUSTER)
    spec = cluster["spec"]
    assert spec["instances"] == 3
    assert re.search(r":18(\.\d+)?(-|$)", spec["imageName"]), "PostgreSQL 18"
    assert spec["enableSuperuserAccess"] is False
    initdb = spec["bootstrap"]["initdb"]
    assert initdb["database"] == "qinglong"
    assert initdb["owner"] == "qinglong_migration"
    assert initdb["secret"]["name"] == DB_SECRET_OF_ROLE["qinglong_migration"]
    roles = {role["name"]: role for role in spec["managed"]["roles"]}
    assert set(roles) == set(DB_SECRET_OF_ROLE)
    for name, role in roles.items():
        assert role["passwordSecret"]["name"] == DB_SECRET_OF_ROLE[name]
        assert role["login"] is True
        for privilege in ("superuser", "createdb", "createrole", "replication", "bypassrls"):
            assert role[privilege] is False, (name, privilege)


def _cpu_cores(quantity: str) -> int:
    """A CPU limit in whole cores, rounded up, as the services read it from their cgroup."""
    millis = int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)
    return -(-millis // 1000)


def _pool_connections(deployment: Resource, pools: int) -> int:
    """The most connections one pod of ``deployment`` opens through a main pool sized
    from its CPU limit (QINGLONG_POOL_MAX_SIZE, if set, instead)."""
    (container,) = _pod_spec(deployment)["containers"]
    explicit = _env(container).get(ENV_POOL_MAX_SIZE)
    if explicit is not None:
        return int(explicit["value"]) * pools
    return default_max_size(_cpu_cores(container["resources"]["limits"]["cpu"])) * pools


def test_the_services_connections_fit_postgres_limits() -> None:
    # During a rolling update one more pod of each runs (maxSurge).
    spec = _find("Cluster", POSTGRES_CLUSTER)["spec"]
    limits = {role["name"]: role["connectionLimit"] for role in spec["managed"]["roles"]}
    needed: dict[str, int] = {}
    for name, per_pod in (
        (CONTROL, {"qinglong_runtime": 1, "qinglong_admin": 0}),
        (INGRESS, {"qinglong_ingress": 1}),
    ):
        deployment = _find("Deployment", name)
        pods = (
            deployment["spec"]["replicas"]
            + deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
        )
        for role, pools in per_pod.items():
            per = _pool_connections(deployment, pools) if pools else ADMIN_POOL_MAX_SIZE
            if role == "qinglong_runtime":
                per += RECONCILER_POOL_MAX_SIZE  # the reconciler's own connection
            needed[role] = pods * per
    for role, count in needed.items():
        assert count <= limits[role], (role, count, limits[role])
    # Every role at its limit still leaves room for CloudNativePG's own connections.
    max_connections = int(spec["postgresql"]["parameters"]["max_connections"])
    assert sum(limits.values()) + 10 <= max_connections, (limits, max_connections)


# --- network policy ---------------------------------------------------------------------------


def _policy_types(policy: Resource) -> list[str]:
    spec = policy["spec"]
    default = ["Ingress", "Egress"] if "egress" in spec else ["Ingress"]
    types: list[str] = spec.get("policyTypes", default)
    return types


def _policies(labels: Mapping[str, str], direction: str) -> list[Resource]:
    return [
        policy
        for policy in _of_kind("NetworkPolicy")
        if _selects(policy["spec"]["podSelector"], labels) and direction in _policy_types(policy)
    ]


def _rules(labels: Mapping[str, str], direction: str) -> list[Resource]:
    key = "ingress" if direction == "Ingress" else "egress"
    return [
        rule for policy in _policies(labels, direction) for rule in policy["spec"].get(key) or []
    ]


def _ports(rule: Resource) -> set[tuple[str, int]]:
    return {(port.get("protocol", "TCP"), port["port"]) for port in rule.get("ports", [])}


def _same_namespace_peer_admits(peer: Resource, labels: Mapping[str, str]) -> bool:
    assert "ipBlock" not in peer, peer
    if "namespaceSelector" in peer:
        return False  # another namespace
    return _selects(peer.get("podSelector"), labels)


def _admitted(labels: Mapping[str, str], source: Mapping[str, str]) -> set[tuple[str, int]]:
    """Ports on pods with `labels` that a pod with `source` labels, in the same namespace,
    may connect to."""
    ports: set[tuple[str, int]] = set()
    for rule in _rules(labels, "Ingress"):
        peers = rule.get("from")
        if not peers or any(_same_namespace_peer_admits(peer, source) for peer in peers):
            ports |= _ports(rule) or {("*", 0)}
    return ports


def test_the_namespace_denies_inbound_traffic_by_default() -> None:
    policy = _find("NetworkPolicy", "default-deny-ingress")
    assert policy["spec"]["podSelector"] == {}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert not policy["spec"].get("ingress")


def _is_scrape_rule(rule: Resource) -> bool:
    """Prometheus's namespace, to the metrics port and nothing else."""
    return rule.get("from") == [{"namespaceSelector": MONITORING}] and _ports(rule) == {
        ("TCP", METRICS_PORT)
    }


def test_only_ingress_pods_reach_control() -> None:
    assert _policies(CONTROL_POD, "Ingress"), "no NetworkPolicy selects the control pods"
    for rule in _rules(CONTROL_POD, "Ingress"):
        assert rule.get("from"), "a rule without `from` admits every source"
        if _is_scrape_rule(rule):
            continue
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"control admits {peer}"
            assert _selects(peer["podSelector"], INGRESS_POD)
    assert _admitted(CONTROL_POD, INGRESS_POD) == {("TCP", 7443)}
    for source in (CONTROL_POD, MIGRATE_POD, WORKER_POD, POSTGRES_POD, *STRANGER_PODS):
        assert _admitted(CONTROL_POD, source) == set(), f"{source} can reach control"


def test_ingress_pods_are_reachable_on_their_two_ports_from_anywhere() -> None:
    rules = _rules(INGRESS_POD, "Ingress")
    open_rules = [rule for rule in rules if not rule.get("from")]
    assert open_rules, "ingress must be reachable from outside the namespace"
    both = {("TCP", PUBLIC_PORT), ("TCP", ENROLLMENT_PORT)}
    assert set().union(*(_ports(rule) for rule in open_rules)) == both
    assert all(_ports(rule) <= both or _is_scrape_rule(rule) for rule in rules)
    for source in (WORKER_POD, *STRANGER_PODS):
        assert _admitted(INGRESS_POD, source) == both, source


def test_the_migration_job_accepts_nothing() -> None:
    assert _policies(MIGRATE_POD, "Ingress")
    assert _rules(MIGRATE_POD, "Ingress") == []


def test_workers_accept_only_the_scrape_of_their_metrics() -> None:
    assert _policies(WORKER_POD, "Ingress")
    rules = _rules(WORKER_POD, "Ingress")
    assert rules
    assert all(_is_scrape_rule(rule) for rule in rules)
    for source in (CONTROL_POD, INGRESS_POD, WORKER_POD, *STRANGER_PODS):
        assert _admitted(WORKER_POD, source) == set(), f"{source} can reach a Worker"


@pytest.mark.parametrize(
    "labels", [CONTROL_POD, INGRESS_POD, WORKER_POD], ids=["control", "ingress", "worker"]
)
def test_only_the_monitoring_namespace_reaches_the_metrics_port(labels: dict[str, str]) -> None:
    scrape = [rule for rule in _rules(labels, "Ingress") if ("TCP", METRICS_PORT) in _ports(rule)]
    assert scrape, f"{labels} cannot be scraped"
    assert all(_is_scrape_rule(rule) for rule in scrape)
    for source in STRANGER_PODS:
        assert ("TCP", METRICS_PORT) not in _admitted(labels, source)


@pytest.mark.parametrize(
    ("name", "variable"),
    [
        (CONTROL, "QINGLONG_CONTROL_METRICS_PORT"),
        (INGRESS, "QINGLONG_INGRESS_METRICS_PORT"),
        (WORKER, None),
    ],
    ids=["control", "ingress", "worker"],
)
def test_workloads_serve_metrics_where_their_scrape_annotations_say(
    name: str, variable: str | None
) -> None:
    workload = _find(WORKLOAD_KIND[name], name)
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/port") == str(METRICS_PORT)
    assert annotations.get("prometheus.io/path") == "/metrics"
    (container,) = _pod_spec(workload)["containers"]
    ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
    assert ports.get("metrics") == METRICS_PORT
    if variable is not None:
        assert _env_value(container, variable) == str(METRICS_PORT)
    else:
        command = list(container["command"])
        assert command[command.index("--metrics-port") + 1] == str(METRICS_PORT)


def test_postgres_accepts_only_role_holders_and_its_own_machinery() -> None:
    for source in (CONTROL_POD, INGRESS_POD, MIGRATE_POD):
        assert _admitted(POSTGRES_POD, source) == {("TCP", 5432)}, source
    for source in (WORKER_POD, *STRANGER_PODS):
        assert _admitted(POSTGRES_POD, source) == set(), f"{source} can reach PostgreSQL"
    assert _admitted(POSTGRES_POD, POSTGRES_POD) == {("TCP", 5432), ("TCP", 8000)}


def _destination(rule: Resource) -> str:
    peers = rule.get("to")
    assert peers, f"egress rule {rule} allows every destination"
    (peer,) = peers
    assert "ipBlock" not in peer, peer
    namespaces = peer.get("namespaceSelector")
    pods = peer.get("podSelector", {})
    if namespaces == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}:
        assert pods == {"matchLabels": {"k8s-app": "kube-dns"}}
        assert _ports(rule) == {("UDP", 53), ("TCP", 53)}
        return "dns"
    if namespaces == MONITORING:
        # The OpenTelemetry collector's OTLP/gRPC port, nothing else there.
        assert pods == COLLECTOR_POD, peer
        assert _ports(rule) == {("TCP", OTLP_PORT)}
        return "otlp"
    assert namespaces is None, peer
    if _selects(pods, POSTGRES_POD) and not _selects(pods, CONTROL_POD):
        assert _ports(rule) == {("TCP", 5432)}
        return "postgres"
    if _selects(pods, CONTROL_POD) and not _selects(pods, INGRESS_POD):
        assert _ports(rule) == {("TCP", 7443)}
        return "control"
    if _selects(pods, INGRESS_POD) and not _selects(pods, CONTROL_POD):
        # Exactly ingress's two listeners: the mTLS channel and enrollment.
        assert _ports(rule) == {("TCP", PUBLIC_PORT), ("TCP", ENROLLMENT_PORT)}
        return "ingress"
    pytest.fail(f"unexpected egress destination {peer}")


@pytest.mark.parametrize(
    ("labels", "allowed"),
    [
        (CONTROL_POD, {"dns", "postgres", "otlp"}),
        (INGRESS_POD, {"dns", "postgres", "control", "otlp"}),
        (MIGRATE_POD, {"dns", "postgres"}),
        (WORKER_POD, {"dns", "ingress", "otlp"}),
    ],
    ids=["control", "ingress", "migrate", "worker"],
)
def test_egress_is_restricted(labels: dict[str, str], allowed: set[str]) -> None:
    assert _policies(labels, "Egress"), f"egress of {labels} is not restricted"
    assert {_destination(rule) for rule in _rules(labels, "Egress")} == allowed


# --- workloads ----------------------------------------------------------------------------------


def _check_security_context(pod_spec: Resource, container: Resource) -> None:
    pod = pod_spec.get("securityContext", {})
    own = container.get("securityContext", {})
    assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True
    assert own.get("runAsUser", pod.get("runAsUser", 0)) != 0
    assert own.get("readOnlyRootFilesystem") is True
    assert own.get("allowPrivilegeEscalation") is False
    assert own.get("privileged", False) is False
    assert own.get("capabilities") == {"drop": ["ALL"]}
    seccomp = own.get("seccompProfile", pod.get("seccompProfile"))
    assert seccomp == {"type": "RuntimeDefault"}


def _check_resources(container: Resource) -> None:
    resources = container["resources"]
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources.get(bound, {})), (container["name"], bound)


def test_the_workloads_are_exactly_these() -> None:
    assert {_label(w) for w in _workloads()} == {
        f"{kind}/{name}" for name, kind in WORKLOAD_KIND.items()
    }


@pytest.mark.parametrize("name", list(WORKLOAD_KIND))
def test_every_container_is_locked_down(name: str) -> None:
    workload = _find(WORKLOAD_KIND[name], name)
    claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    pod_spec = _pod_spec(workload)
    assert pod_spec["automountServiceAccountToken"] is False
    account = _find("ServiceAccount", pod_spec["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert pod_spec.get("hostNetwork", False) is False
    assert pod_spec.get("hostPID", False) is False
    for container in _containers(workload):
        _check_security_context(pod_spec, container)
        _check_resources(container)
        # Writable paths are only memory-backed scratch space and, for the Worker, its
        # own claim (identity and inbox).
        volumes = {volume["name"]: volume for volume in pod_spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            if mount["name"] in claims:
                assert mount["name"] not in volumes, "a claim shadowed by a pod volume"
                continue
            volume = volumes[mount["name"]]
            if "emptyDir" in volume:
                assert volume["emptyDir"].get("medium") == "Memory", mount
                assert volume["emptyDir"].get("sizeLimit"), mount
            else:
                assert mount.get("readOnly") is True, mount


def _check_probe(probe: Resource, container: Resource) -> None:
    if "grpc" in probe:
        port = probe["grpc"]["port"]
        assert port in {p["containerPort"] for p in container["ports"]}
        return
    # Both servers require a client certificate, which the kubelet's gRPC probe cannot
    # present: the probe is the service's own `probe` subcommand, run in the container.
    command = probe["exec"]["command"]
    assert command[:2] == [container["command"][0], "probe"], command
    assert probe["timeoutSeconds"] >= 2


@pytest.mark.parametrize("name", [CONTROL, INGRESS])
def test_deployments_are_highly_available_and_probed(name: str) -> None:
    deployment = _find("Deployment", name)
    spec = deployment["spec"]
    labels = _pod_labels(deployment)
    assert spec["replicas"] == 3
    assert _selects(spec["selector"], labels)
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod_spec = _pod_spec(deployment)
    # SPEC R-HA-1: replicas on different nodes. Preferred only: a required rule would
    # block the rolling update's surge pod on a cluster with as many nodes as replicas.
    anti = pod_spec["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    terms = [t["podAffinityTerm"] for t in anti["preferredDuringSchedulingIgnoredDuringExecution"]]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname" and _selects(t["labelSelector"], labels)
        for t in terms
    ), f"{name}: no pod anti-affinity across nodes"
    spread = {c["topologyKey"]: c for c in pod_spec["topologySpreadConstraints"]}
    node = spread["kubernetes.io/hostname"]
    assert node["whenUnsatisfiable"] == "DoNotSchedule"
    assert node["maxSkew"] == 1
    assert _selects(node["labelSelector"], labels)
    for container in _containers(deployment):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert kind in container, f"{name}/{container['name']}: no {kind}"
            _check_probe(container[kind], container)
    budgets = [
        p for p in _of_kind("PodDisruptionBudget") if _selects(p["spec"]["selector"], labels)
    ]
    assert len(budgets) == 1, f"{name}: {len(budgets)} PodDisruptionBudgets"
    budget = budgets[0]["spec"]
    assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable") == 2


def test_ingress_readiness_asks_both_of_its_grpc_listeners() -> None:
    """The public listener and Worker enrollment each serve health (SPEC B-OPS): a pod
    whose enrollment listener stopped serving is taken out of the Service too."""
    [container] = _containers(_find("Deployment", INGRESS))
    grpc_ports = {p["containerPort"] for p in container["ports"] if p["name"] != "metrics"}
    assert len(grpc_ports) == 2
    command = container["readinessProbe"]["exec"]["command"]
    asked = {int(a.rsplit(":", 1)[1]) for a in command if a.startswith("--address=")}
    assert asked == grpc_ports, command


def test_one_image_runs_every_container() -> None:
    images = {container["image"] for w in _workloads() for container in _containers(w)}
    assert images == {"qinglong:dev"}


def test_migration_job_runs_once_per_release_before_the_services() -> None:
    job = _find("Job", MIGRATE)
    spec = job["spec"]
    assert 1 <= spec["backoffLimit"] <= 10
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["activeDeadlineSeconds"] > 0
    assert _pod_spec(job)["restartPolicy"] == "Never"
    annotations = job["metadata"]["annotations"]
    assert annotations["argocd.argoproj.io/hook"] == "Sync"
    assert annotations["argocd.argoproj.io/hook-delete-policy"] == "BeforeHookCreation"

    def wave(kind: str, name: str) -> int:
        annotations = _find(kind, name)["metadata"].get("annotations", {})
        return int(annotations.get("argocd.argoproj.io/sync-wave", "0"))

    for secret in [*DB_SECRET_OF_ROLE.values(), WORKER_JOIN_SECRET]:
        assert wave("Secret", secret) < wave("Cluster", POSTGRES_CLUSTER)
    # The Worker joins through ingress's enrollment listener, so it comes last.
    assert (
        wave("Cluster", POSTGRES_CLUSTER)
        < wave("Job", MIGRATE)
        < wave("Deployment", CONTROL)
        < wave("Deployment", INGRESS)
        < wave("StatefulSet", WORKER)
    )


# --- wiring: services, addresses, TLS identities -------------------------------------------------


def _listen_port(container: Resource, variable: str) -> int:
    return int(_env_value(container, variable).rpartition(":")[2])


def _service_target(service_name: str, port: int) -> int:
    """The container port behind `port` of a Service (resolved through the named port of
    the Deployment it selects)."""
    service = _find("Service", service_name)
    container = _only_container(_find("Deployment", service_name))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    target = service_port["targetPort"]
    return ports[target] if isinstance(target, str) else int(target)


def test_services_route_to_the_listening_ports() -> None:
    control = _only_container(_find("Deployment", CONTROL))
    ingress = _only_container(_find("Deployment", INGRESS))
    for name, container, variables, kind in (
        (CONTROL, control, {"grpc": "QINGLONG_CONTROL_LISTEN_ADDRESS"}, "ClusterIP"),
        (
            INGRESS,
            ingress,
            {
                "grpc": "QINGLONG_INGRESS_LISTEN_ADDRESS",
                "enroll": "QINGLONG_INGRESS_ENROLLMENT_LISTEN_ADDRESS",
            },
            # The base's LoadBalancer, made a ClusterIP by the dev overlay (below).
            "ClusterIP",
        ),
    ):
        service = _find("Service", name)
        assert service["spec"]["type"] == kind
        assert _selects(
            {"matchLabels": service["spec"]["selector"]}, _pod_labels(_find("Deployment", name))
        )
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # The metrics port is scraped per pod (annotations), never behind the Service.
        assert set(ports) == {*variables, "metrics"}, f"{name}: container ports"
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert set(service_ports) == set(variables), f"{name}: Service ports"
        for port_name, variable in variables.items():
            assert service_ports[port_name]["targetPort"] == port_name
            assert ports[port_name] == _listen_port(container, variable), (name, port_name)
    address = _env_value(ingress, "QINGLONG_INGRESS_CONTROL_ADDRESS")
    control_service = _find("Service", CONTROL)
    assert address == (
        f"{CONTROL}.{NAMESPACE}.svc.cluster.local:{control_service['spec']['ports'][0]['port']}"
    )


def _base_service(name: str) -> Resource:
    (service,) = [
        r for r in _render(K8S / "base") if r["kind"] == "Service" and r["metadata"]["name"] == name
    ]
    return service


def test_the_ingress_load_balancer_keeps_the_callers_addresses() -> None:
    """With externalTrafficPolicy Cluster, kube-proxy may SNAT an outside caller to a
    node's address: the enrollment rate limit per peer and the audit's peer would see
    nodes, not callers."""
    spec = _base_service(INGRESS)["spec"]
    assert spec["type"] == "LoadBalancer"
    assert spec["externalTrafficPolicy"] == "Local"


def test_the_dev_overlay_exposes_nothing_outside_the_cluster() -> None:
    """Its credentials are public placeholders (a cluster admin's token among them), so
    its ingress is a ClusterIP, reached with kubectl port-forward."""
    assert (
        PLACEHOLDER_MARK
        in base64.b64decode(_find("Secret", "qinglong-admin-token")["data"]["token"]).decode()
    )
    for service in _of_kind("Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", _label(service)
        # The API server accepts externalTrafficPolicy only on an external Service.
        assert "externalTrafficPolicy" not in service["spec"], _label(service)
        assert not service["spec"].get("externalIPs"), _label(service)
    # The overlay changes the type and nothing else of the base's Service.
    base = copy.deepcopy(_base_service(INGRESS))
    base["spec"]["type"] = "ClusterIP"
    del base["spec"]["externalTrafficPolicy"]
    assert _find("Service", INGRESS) == base


def _certificate_for_secret(secret_name: str) -> Resource:
    (certificate,) = [c for c in _of_kind("Certificate") if c["spec"]["secretName"] == secret_name]
    return certificate


def _tls_secret(deployment: str, variable: str) -> tuple[str, str]:
    workload = _find("Deployment", deployment)
    container = _only_container(workload)
    return _mounted_secret_file(_pod_spec(workload), container, _env_value(container, variable))


@pytest.mark.parametrize(
    ("deployment", "prefix"),
    [
        (CONTROL, "QINGLONG_CONTROL_TLS"),
        (INGRESS, "QINGLONG_INGRESS_TLS"),
        (INGRESS, "QINGLONG_INGRESS_CONTROL_TLS"),
    ],
)
def test_tls_files_come_from_one_mounted_secret(deployment: str, prefix: str) -> None:
    found = {
        suffix: _tls_secret(deployment, f"{prefix}_{suffix}") for suffix in ("CA", "CERT", "KEY")
    }
    assert {secret for secret, _ in found.values()} == {found["CERT"][0]}
    assert {suffix: key for suffix, (_, key) in found.items()} == {
        "CA": "ca.crt",
        "CERT": "tls.crt",
        "KEY": "tls.key",
    }


def test_control_admits_exactly_the_ingress_client_identity() -> None:
    control = _only_container(_find("Deployment", CONTROL))
    allowed = set(_env_value(control, "QINGLONG_CONTROL_ALLOWED_CALLER_URIS").split(","))
    client_secret, _ = _tls_secret(INGRESS, "QINGLONG_INGRESS_CONTROL_TLS_CERT")
    client = _certificate_for_secret(client_secret)["spec"]
    assert allowed == set(client["uris"]) == {f"spiffe://{TRUST_DOMAIN}/service/ingress"}
    assert "client auth" in client["usages"]
    server_secret, _ = _tls_secret(CONTROL, "QINGLONG_CONTROL_TLS_CERT")
    server = _certificate_for_secret(server_secret)["spec"]
    assert not allowed & set(server["uris"]), "control's own identity must not be a caller"


@pytest.mark.parametrize(
    ("deployment", "variable"),
    [(CONTROL, "QINGLONG_CONTROL_TLS_CERT"), (INGRESS, "QINGLONG_INGRESS_TLS_CERT")],
)
def test_server_certificates_fit_their_names_and_the_probe(deployment: str, variable: str) -> None:
    secret, _ = _tls_secret(deployment, variable)
    spec = _certificate_for_secret(secret)["spec"]
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert "localhost" in spec["dnsNames"]  # the probe dials 127.0.0.1 as "localhost"
    assert spec["privateKey"]["algorithm"] == "RSA"  # see qinglong_cli.pki
    assert spec["uris"] == [
        f"spiffe://{TRUST_DOMAIN}/service/{deployment.removeprefix('qinglong-')}"
    ]
    if deployment == CONTROL:
        ingress = _only_container(_find("Deployment", INGRESS))
        host = _env_value(ingress, "QINGLONG_INGRESS_CONTROL_ADDRESS").rpartition(":")[0]
        assert host in spec["dnsNames"]


# --- Workers and enrollment ----------------------------------------------------------------------


def _worker() -> Resource:
    return _find("StatefulSet", WORKER)


def _worker_containers() -> tuple[Resource, Resource]:
    spec = _pod_spec(_worker())
    (join,) = spec["initContainers"]
    (daemon,) = spec["containers"]
    return join, daemon


def _expand(container: Resource, value: str, environ: Mapping[str, str] | None = None) -> str:
    """Kubernetes' $(VAR) expansion in command/args, from the container's own env."""
    values = {name: variable.get("value") for name, variable in _env(container).items()}
    values.update(environ or {})

    def one(match: re.Match[str]) -> str:
        found = values.get(match[1])
        assert isinstance(found, str), f"$({match[1]}) is not a literal variable"
        return found

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def _flags(argv: list[str]) -> dict[str, str]:
    assert all(a.startswith("--") for a in argv[::2]), argv
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    assert len(flags) == len(argv) // 2, f"a repeated flag in {argv}"
    return flags


def _join_flags() -> dict[str, str]:
    join, _ = _worker_containers()
    return {flag: _expand(join, value) for flag, value in _flags(join["args"]).items()}


def _daemon_flags() -> dict[str, str]:
    _, daemon = _worker_containers()
    assert daemon["command"][:2] == ["qinglong-worker", "run"]
    assert not daemon.get("args")
    return _flags(daemon["command"][2:])


def _claim_mount(container: Resource) -> PurePosixPath:
    (template,) = _worker()["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == template["metadata"]["name"]]
    assert not mount.get("readOnly"), "the claim holds what the Worker writes"
    assert "subPath" not in mount
    return PurePosixPath(mount["mountPath"])


def _run_join_guard(tmp_path: Path, identity: Path, token: Path) -> tuple[int, list[str]]:
    """Run the init container's command as the kubelet would (its $(VAR)s expanded, the
    identity and token paths moved under tmp_path) against a stand-in qinglong-worker that
    records its argv and writes worker.json as a successful join does; return the exit
    status and the argv lists the stand-in received."""
    join, _ = _worker_containers()
    environ = {"IDENTITY_DIR": str(identity), "JOIN_TOKEN_FILE": str(token)}
    argv = [_expand(join, part, environ) for part in [*join["command"], *join["args"]]]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    stand_in = bin_dir / "qinglong-worker"
    stand_in.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{calls}"\n'
        'while [ "$#" -gt 0 ]; do\n'
        '  if [ "$1" = --dir ]; then mkdir -p "$2" && echo "{}" > "$2/' + IDENTITY_FILE + '"; fi\n'
        "  shift\n"
        "done\n"
    )
    stand_in.chmod(0o755)
    shell = shutil.which(SHELL)
    assert shell, f"no {SHELL} to run the guard with"
    result = subprocess.run(
        [shell, *argv[1:]],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **environ},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    made = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return result.returncode, made


def test_the_worker_joins_at_most_once(tmp_path: Path) -> None:
    """A join token is single use: a restarted pod, whose claim already holds worker.json
    (the file a successful join writes last), must not join again."""
    join, _ = _worker_containers()
    assert join["command"][:2] == [SHELL, "-c"]
    script = join["command"][2]
    assert f"/{IDENTITY_FILE}" in script, "the guard tests the file join writes last"
    assert "exec qinglong-worker join" in script
    flags = _join_flags()
    identity_dir = _expand(join, "$(IDENTITY_DIR)")
    assert flags["--dir"] == identity_dir

    token = tmp_path / "token"
    token.write_text("qlj1_x\n")
    identity = tmp_path / "claim" / "identity"
    # First start: no identity yet, so it joins, once, with the manifest's flags.
    status, calls = _run_join_guard(tmp_path, identity, token)
    assert status == 0
    (call,) = calls
    assert call.split()[0] == "join"
    assert f"--dir {identity}" in call
    assert f"--token-file {token}" in call
    assert (identity / IDENTITY_FILE).is_file()
    # Restarts: the identity is there; it does not join again, even with a token.
    for _ in range(2):
        assert _run_join_guard(tmp_path, identity, token) == (0, [])
    # A fresh claim without the (optional) token Secret fails loudly, joining nothing.
    status, calls = _run_join_guard(tmp_path, tmp_path / "other", tmp_path / "absent")
    assert status != 0
    assert calls == []


def test_the_worker_reads_its_token_from_its_secret_and_the_ca_from_the_bundle() -> None:
    worker = _worker()
    spec = _pod_spec(worker)
    join, daemon = _worker_containers()
    # Its join token is the only Secret it names: never the CA's (see below).
    assert _secret_references(spec) == {WORKER_JOIN_SECRET}
    assert not _secret_references({"containers": [join, daemon]}), "no Secret in env"
    flags = _join_flags()
    assert "--token" not in flags, "a token on the command line is visible in ps"
    assert _mounted_secret_file(spec, join, flags["--token-file"]) == (WORKER_JOIN_SECRET, "token")
    assert _mounted_file(spec, join, flags["--ca"]) == ("ConfigMap", CA_BUNDLE, "ca.crt")
    volumes = {v["name"]: v for v in spec["volumes"] if "secret" in v or "configMap" in v}
    (token,) = [v["secret"] for v in volumes.values() if "secret" in v]
    (bundle,) = [v["configMap"] for v in volumes.values() if "configMap" in v]
    # Only the needed keys, the token owner-read-only.
    assert token["items"] == [{"key": "token", "path": "token"}]
    assert token["defaultMode"] == 0o400
    assert bundle["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    # The daemon needs neither: its files are on the claim (worker.json names them).
    assert {m["name"] for m in daemon["volumeMounts"]} & set(volumes) == set()
    secret = _find("Secret", WORKER_JOIN_SECRET)
    assert set(secret["data"]) == {"token"}
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert PLACEHOLDER_MARK in token, "a marked placeholder, not a secret"
    assert bounds.JOIN_TOKEN_PATTERN.match(token), "in the shape join accepts"


def test_the_worker_keeps_its_identity_and_inbox_on_the_claim() -> None:
    worker = _worker()
    spec = worker["spec"]
    assert spec["replicas"] == 1, "one join token, one identity"
    (template,) = spec["volumeClaimTemplates"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }
    join, daemon = _worker_containers()
    claim = _claim_mount(join)
    assert _claim_mount(daemon) == claim
    identity_dir = PurePosixPath(_join_flags()["--dir"])
    assert identity_dir.is_relative_to(claim)
    flags = _daemon_flags()
    assert set(flags) == {"--identity", "--inbox", "--metrics-port"}
    assert PurePosixPath(flags["--identity"]) == identity_dir / IDENTITY_FILE
    inbox = PurePosixPath(flags["--inbox"])
    # logs/ and exits/ are created beside the inbox: on the claim too, apart from the key.
    assert inbox.is_relative_to(claim)
    assert not inbox.is_relative_to(identity_dir)
    # Time to drain: > drain grace (30 s) + stop grace (5 s), README "Workers".
    assert _pod_spec(worker)["terminationGracePeriodSeconds"] >= 45


_BINARY_UNITS: dict[str, int] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def test_the_workers_claim_holds_its_output_at_the_limit() -> None:
    """Executor output is written to the claim beside the inbox: a full claim stops the
    inbox, and with it every Run of the Worker. The daemon's own settings (its flags and
    environment, read by its parser) bound what running executors write at once to at
    most half the claim, the rest for the inbox and the closed records' files."""
    (template,) = _worker()["spec"]["volumeClaimTemplates"]
    size = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", template["spec"]["resources"]["requests"]["storage"])
    assert size is not None
    claim_bytes = int(size[1]) * _BINARY_UNITS[size[2]]
    _, daemon = _worker_containers()
    environment = {name: str(v.get("value", "")) for name, v in _env(daemon).items()}
    connection = ["--worker-id", "w", "--ingress-address", "i:1"]
    connection += ["--tls-ca", "a", "--tls-cert", "b", "--tls-key", "c"]
    # Not --identity: the parser would read the file, which only the pod has.
    flags = [x for f, v in _daemon_flags().items() if f != "--identity" for x in (f, v)]
    settings = parse_worker_settings(["run", *connection, *flags], environment)[1].daemon
    assert settings is not None
    assert settings.output_limit_bytes is not None, "a Worker in a pod keeps a limit"
    at_once = settings.max_concurrency * settings.output_limit_bytes
    print(f"{settings.max_concurrency} Attempts x {settings.output_limit_bytes} bytes: {at_once}")
    assert at_once <= claim_bytes // 2


def test_the_worker_is_probed_for_liveness_by_its_own_heartbeat_only() -> None:
    """The probe reads the heartbeat beside the inbox the daemon runs on (a probe of
    another path would never see it tick), never ingress; and it outlasts a slow tick."""
    _, daemon = _worker_containers()
    assert "readinessProbe" not in daemon
    assert "startupProbe" not in daemon
    probe = daemon["livenessProbe"]
    _check_probe(probe, daemon)
    command = probe["exec"]["command"]
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert set(flags) == {"--inbox", "--stale-seconds"}
    assert flags["--inbox"] == _daemon_flags()["--inbox"]
    stale = float(flags["--stale-seconds"])
    assert stale >= DEFAULT_STALE_SECONDS
    # Time from a stuck loop to a restart: at most the limit plus the failures allowed.
    assert stale + probe["periodSeconds"] * probe["failureThreshold"] <= 300


def test_the_worker_dials_ingress_by_its_service_names() -> None:
    flags = _join_flags()
    ingress_secret, _ = _tls_secret(INGRESS, "QINGLONG_INGRESS_TLS_CERT")
    names = _certificate_for_secret(ingress_secret)["spec"]["dnsNames"]
    ingress = _only_container(_find("Deployment", INGRESS))
    for flag, variable in (
        ("--ingress", "QINGLONG_INGRESS_LISTEN_ADDRESS"),
        ("--enrollment", "QINGLONG_INGRESS_ENROLLMENT_LISTEN_ADDRESS"),
    ):
        host, _, port = flags[flag].rpartition(":")
        assert host == INGRESS_HOST, flag
        assert _service_target(INGRESS, int(port)) == _listen_port(ingress, variable), flag
    # The name both listeners' certificate carries (`run` checks the --ingress host).
    assert flags["--server-name"] == INGRESS_HOST
    assert INGRESS_HOST in names
    # ... and the CA the Worker is given is the one that signs that certificate: its
    # ConfigMap is the Bundle that copies the issuer's CA certificate.
    issuer = _certificate_for_secret(ingress_secret)["spec"]["issuerRef"]["name"]
    ca_secret = _find("Issuer", issuer)["spec"]["ca"]["secretName"]
    join, _ = _worker_containers()
    _, config_map, key = _mounted_file(_pod_spec(_worker()), join, flags["--ca"])
    bundle = _find("Bundle", config_map)["spec"]
    assert bundle["sources"] == [{"secret": {"name": ca_secret, "key": "ca.crt"}}]
    assert bundle["target"]["configMap"] == {"key": key}


def test_the_worker_reaches_exactly_ingress_two_ports() -> None:
    egress = _rules(WORKER_POD, "Egress")
    assert {_destination(rule) for rule in egress} == {"dns", "ingress", "otlp"}
    (to_ingress,) = [rule for rule in egress if _destination(rule) == "ingress"]
    assert _ports(to_ingress) == {("TCP", PUBLIC_PORT), ("TCP", ENROLLMENT_PORT)}
    # ... and ingress admits it there.
    assert _admitted(INGRESS_POD, WORKER_POD) == _ports(to_ingress)


def _secret_volume_sources(volume: Resource) -> list[tuple[str, Resource]]:
    """(Secret name, its projection) of a secret volume or of a projected volume."""
    if "secret" in volume:
        return [(volume["secret"]["secretName"], volume["secret"])]
    sources = volume.get("projected", {}).get("sources", [])
    return [(s["secret"]["name"], s["secret"]) for s in sources if "secret" in s]


def test_control_alone_mounts_the_issuing_ca_key() -> None:
    """Every Secret that backs a CA Issuer holds the CA's private key: only control may
    project its tls.key (to sign joining Workers); anyone else gets ca.crt at most."""
    ca_secrets = {i["spec"]["ca"]["secretName"] for i in _of_kind("Issuer") if "ca" in i["spec"]}
    assert ca_secrets == {CA_SECRET}
    holders: dict[str, set[str]] = {}
    for workload in _workloads():
        for volume in _pod_spec(workload).get("volumes", []):
            for name, secret in _secret_volume_sources(volume):
                if name not in ca_secrets:
                    continue
                assert "items" in secret, f"{_label(workload)} projects all of {name}"
                holders.setdefault(_label(workload), set()).update(
                    item["key"] for item in secret["items"]
                )
    # ca.crt: the roots control names to Workers (QINGLONG_CONTROL_ISSUING_CA_TRUST).
    assert holders == {f"Deployment/{CONTROL}": {"tls.crt", "tls.key", "ca.crt"}}
    (volume,) = [
        v
        for v in _pod_spec(_find("Deployment", CONTROL))["volumes"]
        if v.get("secret", {}).get("secretName") == CA_SECRET
    ]
    assert volume["secret"]["defaultMode"] == 0o400
    for workload in _workloads():
        if workload["metadata"]["name"] != CONTROL:
            assert "ISSUING_CA" not in _all_text(workload), _label(workload)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


@pytest.mark.parametrize(
    "workload",
    [resource for _, resource in RENDERED if resource["kind"] in POD_TEMPLATE_KINDS],
    ids=[name for name, resource in RENDERED if resource["kind"] in POD_TEMPLATE_KINDS],
)
def test_no_pod_but_controls_names_the_ca_secret(workload: Resource) -> None:
    """A pod that names a Secret (a volume, even projecting one key; env; a CSI or image
    pull reference) lets its node's kubelet read the whole Secret. Secret qinglong-ca
    holds the CA's tls.key, so only control's pods may name it; every other pod that
    needs the CA certificate mounts ConfigMap qinglong-ca-bundle."""
    spec = _pod_spec(workload)
    named = CA_SECRET in _secret_references(spec) or CA_SECRET in set(_strings(spec))
    is_control = (workload["kind"], workload["metadata"]["name"]) == ("Deployment", CONTROL)
    assert named == is_control, f"{_label(workload)} names Secret {CA_SECRET}"


def test_the_ca_bundle_copies_only_the_ca_certificate_into_the_namespace() -> None:
    bundle = _find("Bundle", CA_BUNDLE)
    assert bundle["spec"]["sources"] == [{"secret": {"name": CA_SECRET, "key": "ca.crt"}}]
    assert bundle["spec"]["target"] == {
        "configMap": {"key": "ca.crt"},
        # Cluster-scoped: without a selector it would write the ConfigMap everywhere.
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
    }
    # trust-manager owns the ConfigMap: one committed here would fight it.
    assert not [c for c in _of_kind("ConfigMap") if c["metadata"]["name"] == CA_BUNDLE]
    # Every ConfigMap volume of that name projects the certificate and nothing else.
    for workload in _workloads():
        for volume in _pod_spec(workload).get("volumes", []):
            if volume.get("configMap", {}).get("name") == CA_BUNDLE:
                assert volume["configMap"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_the_enrollment_port_is_served_and_open() -> None:
    ingress = _only_container(_find("Deployment", INGRESS))
    port = _listen_port(ingress, "QINGLONG_INGRESS_ENROLLMENT_LISTEN_ADDRESS")
    assert port == ENROLLMENT_PORT
    assert port != _listen_port(ingress, "QINGLONG_INGRESS_LISTEN_ADDRESS"), "a listener of its own"
    assert _env_value(ingress, "QINGLONG_INGRESS_ENROLLMENT_LISTEN_ADDRESS").startswith("0.0.0.0:")
    (service_port,) = [
        p for p in _find("Service", INGRESS)["spec"]["ports"] if p["targetPort"] == "enroll"
    ]
    assert _service_target(INGRESS, service_port["port"]) == port
    assert any(
        not rule.get("from") and ("TCP", port) in _ports(rule)
        for rule in _rules(INGRESS_POD, "Ingress")
    ), "the enrollment port is open to every source"


# --- the image ------------------------------------------------------------------------------------


def _dockerfile_lines() -> list[str]:
    text = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


# The only program a container may run that the image's base (Debian python-slim) brings
# rather than the workspace: a POSIX shell for the Worker's join guard.
SHELL = "sh"


def _commands_used() -> set[str]:
    commands = set()
    for workload in _workloads():
        for container in _containers(workload):
            command = container["command"]
            if command[0] == SHELL:
                assert command[1] == "-c", command
                # What the script runs is what must be installed.
                execs = re.findall(r"\bexec\s+(\S+)", command[2])
                assert execs, f"{container['name']}: a shell that execs nothing"
                commands.update(execs)
                continue
            commands.add(command[0])
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "exec" in container.get(kind, {}):
                    commands.add(container[kind]["exec"]["command"][0])
    return commands


def test_the_dockerfile_builds_the_locked_workspace_as_a_non_root_user() -> None:
    lines = _dockerfile_lines()
    stages = [line for line in lines if line.upper().startswith("FROM ")]
    assert len(stages) >= 2, "multi-stage build"
    syncs = [line for line in lines if "uv sync" in line]
    assert syncs
    assert all("--locked" in line and "--no-dev" in line for line in syncs)
    final = lines[lines.index(stages[-1]) :]
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", " ".join(lines))
    assert base, "the base image is an ARG"
    assert re.fullmatch(r"python:[\d.]+-slim(-\w+)?", base[1]), (
        f"{base[1]}: the Worker's init container needs the {SHELL} of a Debian slim image"
    )
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users, "the final stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), "a numeric USER (runAsNonRoot can only check a number)"
    assert int(uid) != 0, "a non-root USER"
    for workload in _workloads():
        user = _pod_spec(workload)["securityContext"]["runAsUser"]
        assert user == int(uid), _label(workload)
    packages = set(re.findall(r"--package[ =]([A-Za-z0-9_.-]+)", " ".join(lines)))
    package_arg = re.search(r'ARG PACKAGES="([^"]+)"', " ".join(lines))
    if package_arg:
        packages |= set(package_arg[1].split())
    scripts = {
        entry.name: entry.dist.name if entry.dist else ""
        for entry in metadata.entry_points(group="console_scripts")
    }
    for command in _commands_used():
        assert scripts.get(command) in packages, f"{command} is not installed in the image"


def test_postgres_instances_must_land_on_separate_nodes_outside_the_dev_overlay() -> None:
    """A node's loss must not take the primary and its synchronous standby together: the
    deployable base requires one instance per node; only the one-node dev overlay relaxes
    it (CloudNativePG's `podAntiAffinityType`)."""
    [base] = [r for r in _render(K8S / "postgres") if r["kind"] == "Cluster"]
    assert base["spec"]["instances"] >= 3
    assert base["spec"]["affinity"]["podAntiAffinityType"] == "required"
    assert base["spec"]["affinity"]["topologyKey"] == "kubernetes.io/hostname"
    assert _find("Cluster", "qinglong-pg")["spec"]["affinity"]["podAntiAffinityType"] == (
        "preferred"
    )
