"""Stage plumbing shared by every model family: request streams, relay endpoint and sender, engine hookup."""
