"""The trained drafters' networks (EAGLE-3's head, Medusa and Hydra heads) and what they borrow
from the target's vocabulary: what inference runs (`specdec.drafters`) and training fits
(`specdec.training`) alike."""
