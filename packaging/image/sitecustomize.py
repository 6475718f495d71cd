# Installed as the node image's lib/python3.X/sitecustomize.py (packaging/image/assemble.py).
# Debian's site.py looks for distributions only in dist-packages; a cedana prefix keeps
# them in its own lib/python3.X/site-packages (where `cedana node bundle` puts them), so
# `python3 -I` (the installer's check that a payload runs on the host) finds them. The
# launchers run with -S and set their path themselves: this file costs them nothing.
import os
import site

site.addsitedir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "site-packages"))
