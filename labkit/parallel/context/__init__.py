"""Context parallelism: a sequence split over ranks, ring attention and all-to-all between them."""
