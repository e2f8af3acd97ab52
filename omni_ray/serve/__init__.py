"""HTTP serving layer: the OpenAI-compatible protocol and (to come) the Ray Serve ingress."""
