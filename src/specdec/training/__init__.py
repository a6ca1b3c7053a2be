"""Training draft heads on a frozen target: features from the target (`features`), the recipe
(data, vocabulary, features cached and resumable: `recipe`), the trainer every head shares
(`loop`: seeded, checkpointed, DDP under torchrun), what a head borrows from the target's
vocabulary (`vocabulary`), each head type (`eagle3`, `medusa`: Medusa and Hydra), and export to
other engines' layouts (`export`)."""
