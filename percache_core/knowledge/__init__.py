"""The knowledge bank: the user's documents as chunks (chunking, embedding), hybrid
retrieval (BM25 postings and the chunk index, with its snapshot) and the knowledge abstract."""
