"""kvpilot.operator — the Kopf operator for InferenceService (docs/architecture.md#operator).

Package map (one responsibility per module):

- API definition: ``api_names`` (group, kind, labels, ports), ``crd_schema`` (the one OpenAPI schema
  source, assembled: engine, resources, SLO, router and tenancy blocks), ``schema_types`` (patterns and
  typed-field helpers), ``schema_model`` (the model block), ``schema_scaling`` (the scaling and
  autoscaling blocks), ``status_schema`` (the status block), ``crd_rules`` (cross-field rules as CEL
  for the CRD plus the same rule in Python), ``crd`` (the generated CustomResourceDefinition).
- The boundary: ``spec_validation`` (defaults, schema, rules → ``SpecError`` naming the field) and
  ``spec`` (frozen dataclasses the rest of the package reads).
- Deciding: ``sizing`` (N+1 replica count; the external mode's spec.replicas), ``autoscale_decision``
  (the autoscaler's pure decision: windows, cooldown), ``signals`` (engine counters from /metrics or
  Prometheus → per-engine rates), ``autoscaler`` (per-service state, goodput estimate, decision →
  sizing, Events), ``model_size`` (weights of the models known by name, the
  pod memory their loading needs, the scratch volume's size), ``startup`` (startup-probe budget from
  the model), ``model_source`` (what a source names, where its files are in the pod),
  ``model_delivery`` (model volumes, storage requests, the fetch init container), ``pod_template``
  (engine + router containers, probes, placement), ``children`` (Deployment, Services, PDB, router RBAC,
  owner references), ``activator_children`` (scale to zero: the activator's Deployment, the Service's
  target).
- In the pod: ``activator`` (``kvpilot operator activator``: holds requests of a service at zero
  replicas until one is Ready; ``activator_cli``: its flags and process; ``activator_metrics``: its
  Prometheus series, the autoscaler's demand at zero), ``fetch`` (``kvpilot operator fetch-model``, the
  init container that downloads a fetched source, checks its size and sha256), ``s3_signing`` (AWS
  Signature V4 for its S3 requests).
- Acting: ``kube_api`` (dict-based API client), ``child_validation`` (the API server's rules for the
  children, checked before any is written), ``diffing`` (contains/merge-patch), ``apply`` (idempotent
  create-or-patch of the objects the operator owns), ``replicas`` (pod + engine ``/ready`` → stage),
  ``status`` (phase and conditions), ``reconcile`` (one full pass), ``metrics`` (the operator's
  Prometheus series), ``events`` (Kubernetes Events about an InferenceService).
- Running: ``config`` (``OperatorConfig``), ``handlers`` (Kopf registration: changes, watched
  children, resync), ``requeue`` (one reconcile at a time per service, triggers coalesced), ``leader``
  (leader election on a Lease), ``cli`` (``kvpilot operator run|render|crd``), ``cli_checks`` (its
  flags' argparse types and cross-flag checks), ``manifest_yaml`` (stable YAML output).
"""
