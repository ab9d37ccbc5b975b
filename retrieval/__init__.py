"""Ray-free core of retrieval: embedding, chunking, FAISS collections and their persistence.

Nothing here starts Ray. Import the submodules directly (``retrieval.collection``,
``retrieval.store``...); this package module stays empty so that importing, say, the
collection code does not pull in torch.
"""
