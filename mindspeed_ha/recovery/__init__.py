"""Recovery actions run on the ranks: rebuild process groups, write the dying-gasp checkpoint."""
