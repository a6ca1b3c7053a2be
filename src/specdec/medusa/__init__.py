"""Medusa and Hydra heads: training and files (drafting: `specdec.drafters.medusa`)."""
