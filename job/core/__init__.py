"""What every other part uses: errors that say expected / found / fix, and one parser per kind of value."""
