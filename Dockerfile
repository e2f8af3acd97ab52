# omni-ray on the official Ray 2.60 GPU image (Python 3.12): the image the helm chart (helm/omni-ray) runs.
#   docker build -t ghcr.io/omni-ray/omni-ray:0.1.0 .
FROM rayproject/ray:2.60.0-py312-gpu

WORKDIR /home/ray/omni-ray
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users omni_ray ./omni_ray
RUN pip install --no-cache-dir . \
    && python -c "import omni_ray, ray; assert ray.__version__ == '2.60.0', ray.__version__"

# The embedded tiny model, generated at build time so that pods start without generating it.
ENV OMNI_RAY_CACHE=/home/ray/.cache/omni-ray
RUN omni-ray make-tiny
