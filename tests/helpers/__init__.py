"""The one home of the tests' support code: tiny models, trace builders, the CLI runner,
cache access across transformers releases, ports for real servers."""
