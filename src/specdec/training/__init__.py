"""Training draft heads on a frozen target: features from the target (`features`), the recipe
(data, vocabulary, features cached and resumable: `recipe`), the trainer every head shares
(`loop`: seeded, checkpointed, DDP under torchrun), Medusa and Hydra heads' loss and accuracy
(`medusa`; the networks themselves live in `specdec.networks`, which inference imports too),
and export to other engines' layouts (`export`)."""
