"""Plain nn.Module building blocks shared by every model family's backbones."""
