#include <stdio.h>
#include "loom.h"
int main(void) { printf("loom %s\n", loom_version()); return 0; }
