# The pinned vLLM OpenAI-server image with the expert-offload patch series applied, and a
# start-up preflight in front of `vllm serve` (scripts/entrypoint.sh).
#
#   docker build -t vllm-expert-offload .                                    # any hardware
#   docker build --build-arg TOPOLOGY=2x32GB -t vllm-expert-offload:2x32GB .
#
# TOPOLOGY (2x32GB, 3x24GB, 2x24GB or tiny; scripts/eotools/topologies.py) is the hardware the
# preflight checks the GPUs against; compose/<TOPOLOGY>.yml builds that image and carries its
# serving settings (compose/README.md). Arguments and environment are those of the upstream
# image: `docker run ... IMAGE MODEL --pipeline-parallel-size 2 ...` runs `vllm serve` with them.
#
# VLLM_IMAGE's default must be PIN_VLLM_IMAGE of vllm.pin (tests/cpu/test_repo.py checks it):
# the pin lives in vllm.pin, this line only mirrors it for plain `docker build`.
# VLLM_IMAGE_DIGEST (sha256:..., empty by default) builds on exactly that image, whatever the
# tag points to by then: a tag can be moved to other content, a digest cannot. With it the
# reference is NAME:TAG@DIGEST, which Docker and podman resolve by the digest alone. Read the
# digest once from a machine you trust, e.g.
#   docker buildx imagetools inspect vllm/vllm-openai:v0.29.0      # "Digest: sha256:..."
#   docker build --build-arg VLLM_IMAGE_DIGEST=sha256:... -t vllm-expert-offload .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.29.0
ARG VLLM_IMAGE_DIGEST=
FROM ${VLLM_IMAGE}${VLLM_IMAGE_DIGEST:+@${VLLM_IMAGE_DIGEST}}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Where the series, its tools and the cold-file format live in the image. tests/cpu/
# test_image.py runs the patch step below outside Docker, with this (and HOME) moved into a
# scratch folder.
ENV EO_HOME=/opt/expert-offload

# GNU patch applies the series, and lets the preflight check at every start that the series is
# still applied (apply-patches.sh --check), so it stays: a small tool, no compiler. apt's
# package lists and downloads do not.
# hadolint ignore=DL3008
RUN if ! command -v patch >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends patch \
      && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi

# Only these reach the build context (.dockerignore).
COPY vllm.pin ${EO_HOME}/vllm.pin
COPY patches/ ${EO_HOME}/patches/
COPY scripts/ ${EO_HOME}/scripts/
COPY cold/ ${EO_HOME}/cold/

# The patch step. Fails the build if the image's vLLM is not the pinned one, if any hunk does
# not apply exactly (apply-patches.sh names the patch and the file, and changes nothing), or
# if the patched package does not import. Writes no bytecode or other cache into the layer.
RUN site="$(python3 -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("vllm").origin).parents[1])')" \
    && "$EO_HOME/scripts/apply-patches.sh" "$site" \
    && PYTHONDONTWRITEBYTECODE=1 python3 -c "import vllm, vllm.model_executor.layers.fused_moe.expert_offload as eo; \
print('vLLM', vllm.__version__, 'with', eo.__name__)"

# The series' digest (scripts/series-digest) is recorded in the image; a build given
# SERIES_SHA256 (the image workflow passes it, for the label below) fails if it differs.
ARG SERIES_SHA256=""
RUN digest="$("$EO_HOME/scripts/series-digest")" \
    && echo "$digest" > "$EO_HOME/series.sha256" \
    && if [ -n "$SERIES_SHA256" ] && [ "$SERIES_SHA256" != "$digest" ]; then \
         echo "error: SERIES_SHA256=$SERIES_SHA256, but patches/ has digest $digest" >&2; \
         exit 1; \
       fi

# The user the server runs as: not root, so that a flaw in the server or a model's code gets
# no more than this user's rights. Fixed ids (2000:2000 unless built with others), so that a
# state folder bind-mounted from the host can be given to it (compose/README.md, "The image's
# user and the state folder"). It writes only /state (what a budget-only start learns: usage
# counts and the cold files it makes), its home (vLLM's and Triton's compile caches) and /tmp
# (the offload metrics' snapshot folder). /models exists and is its own, so that a new named
# volume mounted there (compose/tiny.yml) starts out writable by it.
ARG EO_UID=2000
ARG EO_GID=2000
RUN groupadd --gid "$EO_GID" vllm \
    && useradd --no-log-init --uid "$EO_UID" --gid "$EO_GID" --home-dir /home/vllm --create-home \
       --shell /usr/sbin/nologin vllm \
    && install -d -o "$EO_UID" -g "$EO_GID" -m 0750 /state /models
ENV HOME=/home/vllm

ARG VLLM_IMAGE
ARG VLLM_IMAGE_DIGEST
ARG TOPOLOGY=any
ARG IMAGE_VERSION=dev
# The repository URL; the image workflow passes it.
ARG IMAGE_SOURCE=""
# A RUN after every ARG the labels use, whose cache key holds their values: podman 4.3's
# layer cache was seen to give a build for another topology the last one's ENV and LABEL
# layers (EO_TOPOLOGY=any kept). scripts/image-build checks each image's values either way.
RUN echo "$TOPOLOGY" > "$EO_HOME/topology"
ENV EO_TOPOLOGY=${TOPOLOGY}
LABEL org.opencontainers.image.title="vllm-expert-offload" \
      org.opencontainers.image.description="vLLM OpenAI server with rarely used MoE experts in host RAM (topology: ${TOPOLOGY})" \
      org.opencontainers.image.source="${IMAGE_SOURCE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${VLLM_IMAGE}" \
      org.opencontainers.image.base.digest="${VLLM_IMAGE_DIGEST}" \
      io.vllm-expert-offload.vllm-image="${VLLM_IMAGE}" \
      io.vllm-expert-offload.series.sha256="${SERIES_SHA256}" \
      io.vllm-expert-offload.topology="${TOPOLOGY}"

USER ${EO_UID}:${EO_GID}
ENTRYPOINT ["/opt/expert-offload/scripts/entrypoint.sh"]
