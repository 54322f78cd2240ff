"""spec.router.auth with the operator running against the real API server: the router pods mount the keys
Secret where the router reads it (admitted in a namespace enforcing the restricted Pod Security level),
and turning auth off rolls the routers without the volume and the flag. The router's own checks are
tested on the process (tests/test_router_auth.py); kwok nodes do not mount volumes."""

from __future__ import annotations

from kubernetes import client

from disagg.api.names import ROUTER_API_KEYS_FILE, ROUTER_AUTH_DIR
from disagg.e2e.testing import DD, dd_manifest, wait_for


def _auth_of(pod) -> tuple[str | None, bool, bool]:
    """(the Secret a router pod mounts where the router reads its keys, mounted read-only, told to read it)."""
    volumes = {v.name: v for v in pod.spec.volumes or []}
    (router,) = pod.spec.containers
    for mount in router.volume_mounts or []:
        v = volumes[mount.name]
        if mount.mount_path == ROUTER_AUTH_DIR and v.secret is not None:
            assert not mount.sub_path, "a subPath mount would never see a rotated Secret"
            told = router.args[router.args.index("--api-keys-file") + 1] == ROUTER_API_KEYS_FILE
            return v.secret.secret_name, bool(mount.read_only), told
    return None, False, "--api-keys-file" in router.args


def test_router_pods_mount_the_keys_secret_and_drop_it_when_auth_is_off(api_client, namespace, operator):
    core = client.CoreV1Api(api_client)
    core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "router-keys"},
                                              "stringData": {"keys": "sk-one\nsk-two\n"}})
    dd = DD(api_client, namespace, dd_manifest("auth", router={"replicas": 2,
                                                               "auth": {"secretName": "router-keys"}}))
    dd.wait_phase("Ready")
    routers = dd.pods("router")
    assert len(routers) == 2
    assert all(_auth_of(p) == ("router-keys", True, True) for p in routers), [_auth_of(p) for p in routers]

    dd.patch_spec({"router": {"auth": None}})
    wait_for(lambda: (pods := dd.pods("router")) and len(pods) == 2
             and all(_auth_of(p) == (None, False, False) for p in pods), 120,
             "the routers rolled without the keys volume")
