"""The n-gram lookup on arrays: hash and sorted tables, cache files, the drafter, the replay."""
