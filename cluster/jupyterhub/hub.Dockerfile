# The hub of the course's Zero to JupyterHub release (values.yaml: hub.image): the chart's own hub
# image (4.4.0, JupyterHub 5.5.0) with the JupyterHub, KubeSpawner and OAuthenticator that
# requirements.txt pins, so that the hub and every server's jupyterhub-singleuser are one release
# (tests/test_cluster_files.py holds the pins equal). Build from the repository root:
#   docker build -f cluster/jupyterhub/hub.Dockerfile -t ghcr.io/training-at-scale/labkit-hub:0.1.0 .
ARG BASE=quay.io/jupyterhub/k8s-hub:4.4.0
FROM ${BASE}

USER root
COPY requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir $(grep -E '^(jupyterhub|jupyterhub-kubespawner|oauthenticator)==' /tmp/requirements.txt) \
 && rm /tmp/requirements.txt
USER jovyan
