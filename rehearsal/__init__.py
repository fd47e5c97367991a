"""The rehearsal: Overworld's rendered Helm chart run as pods on one machine (Linux namespaces on a
bridge, the images built here, NetworkPolicies, RBAC, KubeRay, Prometheus), and the harness pieces the
tests and the benches share with it. README.md says what it emulates of Kubernetes and what it does not.

Importable as `rehearsal` with the repository root on sys.path (pytest's pythonpath, `python -m bench.X`
from the root); nothing is imported here, so a module of the package costs only its own imports.
"""
