from ptops.ops.cli.app import main

main()
