"""Expert parallelism: a mixture of experts' experts split over ranks, tokens sent to them by all-to-all."""
