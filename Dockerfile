# syntax=docker/dockerfile:1
# The pinned vLLM OpenAI-server image with the expert-offload patch series applied.
#
#   docker build -t vllm-expert-offload .
#
# VLLM_IMAGE's default must be PIN_VLLM_IMAGE of vllm.pin (tests/cpu/test_repo.py checks it):
# the pin lives in vllm.pin, this line only mirrors it for plain `docker build`.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.29.0
FROM ${VLLM_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# GNU patch applies the series to the installed package (git is not needed there).
# hadolint ignore=DL3008
RUN if ! command -v patch >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends patch \
      && rm -rf /var/lib/apt/lists/*; \
    fi

COPY vllm.pin /opt/expert-offload/vllm.pin
COPY scripts/lib/ /opt/expert-offload/scripts/lib/
COPY scripts/apply-patches.sh /opt/expert-offload/scripts/apply-patches.sh
COPY patches/ /opt/expert-offload/patches/

# Fails the build if the image's vLLM is not the pinned one, if any hunk does not apply
# exactly, or if the patched package does not import.
RUN site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && /opt/expert-offload/scripts/apply-patches.sh "$site" \
    && python3 -c "import vllm, vllm.model_executor.layers.fused_moe.expert_offload as eo; \
print('vLLM', vllm.__version__, 'with', eo.__name__)"
