from ptops.ops.cli import main

main()
