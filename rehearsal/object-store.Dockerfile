# The rehearsal's stand-in for the chart's SeaweedFS image: moto's S3-protocol server (s3_pod.py) with
# its requests recorded on the pod's volume. Built by `make rehearsal-images` with this directory as
# the context; SeaweedFS' user (1000:1000), as the chart's securityContext expects.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS deps
ARG MOTO_VERSION=5.2.5
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/object-store \
 && /opt/object-store/bin/pip install "moto[server]==${MOTO_VERSION}"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ENV PATH=/opt/object-store/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
COPY --from=deps /opt/object-store /opt/object-store
COPY s3_pod.py /opt/object-store/s3_pod.py
USER 1000:1000
WORKDIR /tmp
EXPOSE 8333
ENTRYPOINT ["python", "/opt/object-store/s3_pod.py"]
CMD ["--port", "8333", "--data", "/data"]
