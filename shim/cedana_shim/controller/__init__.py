"""The cluster-level controller (``cedana controller run``, the chart's
``cedana-controller`` Deployment): the dashboard and its JSON API.

It signs users in with their Kubernetes bearer token (TokenReview), decides what each
may see and do per namespace by SubjectAccessReview against ordinary RBAC verbs, and
reaches the node agents' APIs (node/agent_api.py) with its own ServiceAccount token.
A front end beside task/ and slurm/: nothing below cli/ imports it, and the shim's
hot paths never load it.
"""
