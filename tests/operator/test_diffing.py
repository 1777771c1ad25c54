"""Drift detection: server defaults are not drift, edits of owned fields are, and removals are patched."""

from __future__ import annotations

from kvpilot.operator.diffing import contains, merge_patch

DESIRED = {
    "spec": {
        "replicas": 3,
        "template": {
            "spec": {
                "containers": [{"name": "engine", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]
            }
        },
    }
}


def test_server_defaults_and_equivalent_quantities_are_not_drift():
    live = {
        "spec": {
            "replicas": 3,
            "revisionHistoryLimit": 10,
            "template": {
                "spec": {
                    "dnsPolicy": "ClusterFirst",
                    "containers": [
                        {
                            "name": "engine",
                            "imagePullPolicy": "IfNotPresent",
                            "resources": {"requests": {"cpu": "1000m", "memory": "1Gi"}},
                        }
                    ],
                }
            },
        }
    }
    assert contains(DESIRED, live)
    assert merge_patch(DESIRED, live, DESIRED) == {}


def test_an_edited_owned_field_is_patched_back_whole_list_included():
    live = {
        "spec": {
            "replicas": 9,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "engine", "resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}
                    ]
                }
            },
        }
    }
    assert merge_patch(DESIRED, live, DESIRED) == {
        "spec": {
            "replicas": 3,
            "template": {"spec": {"containers": DESIRED["spec"]["template"]["spec"]["containers"]}},
        }
    }


def test_a_field_the_operator_no_longer_sets_is_removed_and_foreign_fields_stay():
    last = {"metadata": {"labels": {"a": "1", "old": "x"}}}
    live = {"metadata": {"labels": {"a": "1", "old": "x", "theirs": "y"}}}
    assert merge_patch({"metadata": {"labels": {"a": "1"}}}, live, last) == {
        "metadata": {"labels": {"old": None}}
    }


def test_types_matter():
    assert not contains({"port": 80}, {"port": "80"})
    assert not contains({"x": True}, {"x": 1})


def test_a_key_dropped_inside_a_list_element_is_rolled_out():
    # resources.gpus 1 -> 0: the container no longer asks for a GPU. The live container still holds the
    # old limit, so "desired is contained in live" alone would call it converged; the list differs from the
    # one last applied, so it is patched whole (merge patch replaces lists).
    before = [{"name": "engine", "resources": {"limits": {"memory": "1Gi", "nvidia.com/gpu": 1}}}]
    after = [{"name": "engine", "resources": {"limits": {"memory": "1Gi"}}}]
    live = {"containers": [{**before[0], "imagePullPolicy": "IfNotPresent"}]}
    assert merge_patch({"containers": after}, live, {"containers": before}) == {"containers": after}


def test_an_env_list_dropped_from_a_container_is_rolled_out():
    before = [{"name": "fetch", "env": [{"name": "TOKEN", "value": "x"}]}]
    after = [{"name": "fetch"}]
    assert merge_patch({"initContainers": after}, {"initContainers": before}, {"initContainers": before}) == {
        "initContainers": after
    }


def test_a_list_the_operator_did_not_change_is_not_patched_over_server_defaults():
    want = [{"name": "engine", "ports": [{"containerPort": 8000}]}]
    live = [{"name": "engine", "ports": [{"containerPort": 8000, "protocol": "TCP"}]}]
    assert merge_patch({"containers": want}, {"containers": live}, {"containers": want}) == {}


def test_quantities_are_compared_as_quantities_wherever_they_are():
    # kube-apiserver stores a Quantity in canonical form: emptyDir sizeLimit "1.5Gi" reads back "1536Mi".
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": "1.5Gi"}}]
    live = {"volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1536Mi"}}]}
    assert contains({"volumes": volumes}, live)
    assert merge_patch({"volumes": volumes}, live, {"volumes": volumes}) == {}
    assert merge_patch({"emptyDir": {"sizeLimit": "20480Mi"}}, {"emptyDir": {"sizeLimit": "20Gi"}}, {}) == {}
    assert not contains({"emptyDir": {"sizeLimit": "1Gi"}}, {"emptyDir": {"sizeLimit": "2Gi"}})
    # Only quantity fields: a name is not a quantity even when it reads like one.
    assert not contains({"name": "1Gi"}, {"name": "1073741824"})
