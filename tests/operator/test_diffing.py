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
