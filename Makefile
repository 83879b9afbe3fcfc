# SPDX-License-Identifier: GPL-2.0-only
#
# Top-level Makefile of thin-scalable.
#
# Kernel side (kbuild, see Kbuild):
#   make                  build dm-thin-scalable.ko in this tree against KDIR
#   make C=1 / sparse     the same, with sparse (sparse checks every file)
#   make kernels          build against each of KERNELS, each in its own
#                         build/kmod-<kver>/ copy of the sources
#   KDIR=<dir>            kernel build directory (default: that of the
#                         running kernel if installed, else Debian 12's
#                         6.1)
#   KVER=6.12             shortcut: the newest /lib/modules/6.12*/build
#
# Userspace side (everything lands in build/):
#   make tools            build/{opt,asan}/thin-scalable-meta
#   make unit             build/asan/tests/* (the unit tests)
#   make tsan             tools and unit tests under ThreadSanitizer
#   make vm-helpers       build/dm-status (tests/vm/dm-status.c, for the
#                         VM tests: status lines through libdevmapper)
#                         and make lvm2
#   make lvm2             scripts/build-lvm2: Debian's lvm2 with
#                         lvm2/*.patch, lvm and dmeventd under
#                         build/lvm2/src/ (for the VM tests; downloads
#                         the source package once, until make clean)
#   make deps             scripts/install-deps: the Debian packages, if
#                         any is missing (check, bench and fuzz run it)
#   make check            module, tools, unit tests and vm-helpers, then
#                         tests/run (the VM suite boots the kernel the
#                         module is for)
#   make check-6.12       build/kmod-6.12/ (make kmod-6.12) and vm-helpers,
#                         then only the VM suite on Debian 12's 6.12 kernel
#                         with that module (tests/run --vm-only); the
#                         module at the top of the tree is left alone
#   make fuzz, bench-meta  scripts/fuzz-meta, scripts/bench-meta
#   make bench            scripts/bench --meta --callgrind: the VM fio jobs,
#                         then the userspace metadata benchmarks
#   make clean

# --- kernel module --------------------------------------------------------

# Newest /lib/modules/<release>/build whose release is $(1) or starts
# with "$(1)." or "$(1)-" (so that 6.1 does not match 6.12).
kdir-of = $(shell ls -d /lib/modules/$(1)/build /lib/modules/$(1).*/build \
		/lib/modules/$(1)-*/build 2>/dev/null | sort -V | tail -n 1)

ifeq ($(origin KDIR),undefined)
ifneq ($(KVER),)
KDIR := $(call kdir-of,$(KVER))
else
KDIR := $(shell d=/lib/modules/$$(uname -r)/build; \
		if [ -d "$$d" ]; then echo "$$d"; fi)
ifeq ($(KDIR),)
# Debian 12's default kernel (linux-image-amd64) is what CI tests.
KDIR := $(call kdir-of,6.1)
endif
endif
endif

# Kernels "make kernels" builds for, as KVER shortcuts.
KERNELS ?= 6.1 6.12

# What a build/kmod-<kver>/ copy needs: kbuild's input and kernel sources,
# not the *.mod.c that modpost leaves here after "make" or "make sparse":
# an old one copied over a copy's own would be taken for up to date.
KMOD_SOURCES = Kbuild $(filter-out %.mod.c,$(wildcard *.c *.h persistent-data/*.c \
	persistent-data/*.h))

.PHONY: all deps module modules sparse kernels tools unit tsan vm-helpers lvm2 check \
	check-6.12 fuzz bench-meta bench clean FORCE

all: module

check-kdir = @if [ ! -d "$(1)" ]; then \
	echo "no kernel build directory '$(1)'; run scripts/install-deps" \
	     "or set KDIR" >&2; exit 1; fi

module modules:
	$(call check-kdir,$(KDIR))
	$(MAKE) -C $(KDIR) M=$(CURDIR) modules

# C=2 runs sparse on every source, not only on the ones being recompiled.
sparse:
	$(call check-kdir,$(KDIR))
	$(MAKE) -C $(KDIR) M=$(CURDIR) C=2 modules

kernels: $(addprefix kmod-,$(KERNELS))

# Each kernel gets its own copy of the sources so that builds against
# different headers never share (and clobber) objects.  Stale files are
# removed first; cp -p keeps mtimes, so unchanged files are not rebuilt.
kmod-%: FORCE
	$(call check-kdir,$(call kdir-of,$*))
	@mkdir -p build/$@/persistent-data
	@rm -f build/$@/Kbuild build/$@/*.[ch] build/$@/persistent-data/*.[ch]
	@cp -p --parents $(KMOD_SOURCES) build/$@/
	$(MAKE) -C $(call kdir-of,$*) M=$(CURDIR)/build/$@ modules

# --- userspace: tools and unit tests --------------------------------------

# Compiler for userspace only; CC and CFLAGS given on the command line
# would also reach kbuild, which must use the compiler the kernel was
# built with.
UCC ?= gcc

LIBSRC := $(wildcard dm-thin-metadata.c mapping-cache.c persistent-data/*.c user/*.c)
TOOLSRC := $(wildcard tools/*.c)
UNITSRC := $(wildcard tests/unit/*.c)

UCFLAGS := -std=gnu11 -Wall -Wextra -Wno-unused-parameter -Werror -g -I. \
	   -D_GNU_SOURCE -MMD -MP
# RCU readers in userspace: liburcu's membarrier flavour (compat.h).
URCU_LIBS := -lurcu-memb
ULIBS = -lpthread -lexpat $(URCU_LIBS)

opt_CFLAGS := -O2
asan_CFLAGS := -O1 -fsanitize=address,undefined -fno-omit-frame-pointer \
	       -fno-sanitize-recover=all
tsan_CFLAGS := -O1 -fsanitize=thread -fno-omit-frame-pointer

# $(1): flavour.  Objects go to build/<flavour>/obj/<source path>.o.
define flavour
$(1)_LIBOBJ := $$(LIBSRC:%.c=build/$(1)/obj/%.o)
$(1)_TOOLOBJ := $$(TOOLSRC:%.c=build/$(1)/obj/%.o)
$(1)_TESTS := $$(UNITSRC:tests/unit/%.c=build/$(1)/tests/%)
$(1)_TOOLS := $$(if $$(TOOLSRC),build/$(1)/thin-scalable-meta)

build/$(1)/obj/%.o: %.c
	@mkdir -p $$(@D)
	$$(UCC) $$(UCFLAGS) $$($(1)_CFLAGS) -c -o $$@ $$<

build/$(1)/thin-scalable-meta: $$($(1)_TOOLOBJ) $$($(1)_LIBOBJ)
	$$(UCC) $$($(1)_CFLAGS) -o $$@ $$^ $$(ULIBS)

build/$(1)/tests/%: build/$(1)/obj/tests/unit/%.o $$($(1)_LIBOBJ)
	@mkdir -p $$(@D)
	$$(UCC) $$($(1)_CFLAGS) -o $$@ $$^ $$(ULIBS)

-include $$(patsubst %.c,build/$(1)/obj/%.d,$$(LIBSRC) $$(TOOLSRC) $$(UNITSRC))
endef

$(foreach f,opt asan tsan,$(eval $(call flavour,$(f))))

# Keep objects of unit tests (built through a pattern chain) around.
# "unit" also compiles every library object, tests or not, so that a
# userspace compile error shows up in "make check" from the start.
.SECONDARY:

tools: $(opt_TOOLS) $(asan_TOOLS)
	@$(if $(TOOLSRC),:,echo "tools: no tools/*.c yet, nothing to build")

unit: $(asan_LIBOBJ) $(asan_TESTS)
	@$(if $(UNITSRC),:,echo "unit: no tests/unit/*.c yet, nothing to build")

tsan: $(tsan_TOOLS) $(tsan_TESTS)

# --- userspace: helpers of the VM tests (run in the guest) -----------------

# build/dm-status parses a thin pool's or thin device's status with
# libdevmapper's dm_get_status_thin_pool/dm_get_status_thin (lvm2's parser).
VM_HELPERS := build/dm-status

build/dm-status: tests/vm/dm-status.c
	@mkdir -p $(@D)
	$(UCC) $(filter-out -MMD -MP,$(UCFLAGS)) $(opt_CFLAGS) -o $@ $< -ldevmapper

# lvm with our patches, for tests/vm/t-lvm2.sh; the script rebuilds it
# only when lvm2/*.patch or the script change.
lvm2:
	scripts/build-lvm2

vm-helpers: $(VM_HELPERS) lvm2

# --- tests ----------------------------------------------------------------

# The Debian packages the build and the tests need (quick when installed).
deps:
	scripts/install-deps

# A new make, so that KDIR is found in the headers deps may have installed.
check: deps
	$(MAKE) module tools unit tsan vm-helpers
	tests/run

# The userspace tests do not depend on the kernel: "make check" ran them.
check-6.12: deps
	$(MAKE) kmod-6.12 vm-helpers
	TSP_MODULE=$(CURDIR)/build/kmod-6.12/dm-thin-scalable.ko KVER=6.12 \
		tests/run --vm-only

# --- fuzzing and benchmarks (not in CI) ----------------------------------

# make fuzz runs scripts/fuzz-meta; bench-meta runs scripts/bench-meta.
script-of = scripts/$(if $(filter fuzz,$(1)),fuzz-meta,$(1))

fuzz bench-meta: deps
	$(call script-of,$@)

# The main job: the fio jobs in the VM, then on the host the mapping
# cache's lookups/s (scripts/bench-meta) and instructions per lookup
# (scripts/bench-callgrind).
bench: deps
	scripts/bench --meta --callgrind

clean:
	rm -rf build
	@if [ -d "$(KDIR)" ]; then $(MAKE) -C $(KDIR) M=$(CURDIR) clean; fi
