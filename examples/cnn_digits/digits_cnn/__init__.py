"""A user's own components for gradsync: a CNN, digits as 8x8 images, and a sync policy."""
