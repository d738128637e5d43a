"""One module per caffeplus subcommand: add_arguments(parser) and run(args)."""
