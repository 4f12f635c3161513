"""What every other part uses: errors that say expected / found / fix, one parser per kind of value, the
flags read before the config's parser, and paths on a local disk or in Cloud Storage through one type."""
